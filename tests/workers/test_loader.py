"""Loading checkpoints: the layouts warpspec accepts, the one-line errors for those it refuses, and
peak memory while loading."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.waiting import wait_for
from warpspec.training.random_checkpoint import create_random_checkpoint
from warpspec.workers.errors import CheckpointError
from warpspec.workers.loader import READ_AHEAD_BLOCK, ReadAhead, advise_huge_pages, load_model
from warpspec.workers.models.registry import load_model_config


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return create_random_checkpoint(tmp_path / "ckpt", "tiny")


def _rewrite_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _rewrite_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(tmp_path / "empty")


def test_config_that_is_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(checkpoint)


def test_unsupported_architecture(checkpoint):
    _rewrite_config(checkpoint, lambda c: c.update(architectures=["MixtralForCausalLM"], model_type="mixtral"))
    with pytest.raises(CheckpointError, match=r"unsupported architecture \['MixtralForCausalLM'\]"):
        load_model(checkpoint)


def test_missing_config_key(checkpoint):
    _rewrite_config(checkpoint, lambda c: c.pop("hidden_size"))
    with pytest.raises(CheckpointError, match="missing required key 'hidden_size'"):
        load_model(checkpoint)


def test_unsupported_rope_type(checkpoint):
    _rewrite_config(checkpoint, lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))
    with pytest.raises(CheckpointError, match="unsupported rope type 'yarn'"):
        load_model(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    _rewrite_tensors(checkpoint, lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_model(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    _rewrite_tensors(checkpoint, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        load_model(checkpoint)


def test_shape_mismatch_names_tensor_expected_and_got(checkpoint):
    def shrink(t):
        t["model.layers.1.feed_forward.experts.down_proj"] = t["model.layers.1.feed_forward.experts.down_proj"][:3]
    _rewrite_tensors(checkpoint, shrink)
    with pytest.raises(CheckpointError, match=r"shape mismatch for model\.layers\.1\.feed_forward\.experts\.down_proj: "
                                              r"expected \[4, 64, 64\], got \[3, 64, 64\]"):
        load_model(checkpoint)


def test_shape_mismatch_in_a_stacked_tensor(checkpoint):
    def shrink(t):
        t["model.layers.0.self_attn.v_proj.weight"] = t["model.layers.0.self_attn.v_proj.weight"][:8]
    _rewrite_tensors(checkpoint, shrink)
    with pytest.raises(CheckpointError, match=r"v_proj\.weight: expected \[16, 64\], got \[8, 64\]"):
        load_model(checkpoint)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(checkpoint, damage):
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x13\x00garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or unreadable safetensors file"):
        load_model(checkpoint)


def test_no_weights_file(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_model(checkpoint)


def test_sharded_index_with_missing_shard(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, checkpoint / "model-00001-of-00002.safetensors")
    (checkpoint / "model.safetensors").unlink()
    weight_map = {n: "model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors"
                  for i, n in enumerate(names)}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="lists model-00002-of-00002.safetensors, which is missing"):
        load_model(checkpoint)
    save_file({n: tensors[n] for n in names[half:]}, checkpoint / "model-00002-of-00002.safetensors")
    assert load_model(checkpoint).config.num_hidden_layers == 4


def test_bad_dtype(checkpoint):
    with pytest.raises(ValueError, match="dtype 'float64' is not supported"):
        load_model(checkpoint, "float64")


def test_auto_dtype_takes_the_checkpoints(checkpoint):
    _rewrite_config(checkpoint, lambda c: c.update(dtype="bfloat16"))
    assert load_model(checkpoint, "auto").model.embed_tokens.weight.dtype == torch.bfloat16


def test_cpu_experts_hold_the_checkpoints_values_with_the_input_dimension_contiguous(checkpoint):
    """Llama4Experts.lay_out_inputs_contiguous: [E, H, 2I] as before, laid out as [E, 2I, H] in memory."""
    model = load_model(checkpoint, "float32")
    stored = load_file(checkpoint / "model.safetensors")
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.feed_forward, "experts")]
    assert moe_layers
    for i in moe_layers:
        experts = model.model.layers[i].feed_forward.experts
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            expected = stored[f"model.layers.{i}.feed_forward.experts.{name}"].float()
            assert param.shape == expected.shape and param.stride(1) == 1, (i, name, param.stride())
            assert torch.equal(param, expected)


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_the_cpu_logits_head_reads_the_checkpoints_values_with_the_vocabulary_contiguous(tmp_path, tie_word_embeddings):
    """Llama4ForCausalLM.store_head_columns_contiguous: the head is [vocab, hidden] laid out as
    [hidden, vocab]; a tied head reads a copy, and the embedding table keeps its rows contiguous."""
    path = create_random_checkpoint(tmp_path / "ckpt", "tiny", tie_word_embeddings=tie_word_embeddings)
    model = load_model(path, "float32")
    stored = load_file(path / "model.safetensors")
    table = stored["model.embed_tokens.weight"].float()
    head = table if tie_word_embeddings else stored["lm_head.weight"].float()
    weight = model.head_columns if tie_word_embeddings else model.lm_head.weight
    assert (model.head_columns is None) != tie_word_embeddings
    assert weight.shape == head.shape and weight.stride(0) == 1, weight.stride()
    assert torch.equal(weight, head)
    assert model.model.embed_tokens.weight.stride(1) == 1 and torch.equal(model.model.embed_tokens.weight, table)
    hidden = torch.randn(4, head.shape[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ head.T)


def test_generation_config_eos_overrides_config(checkpoint):
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model_config(checkpoint).eos_token_ids == [2, 7]


def test_peak_memory_while_loading_stays_near_model_size(tmp_path):
    """Resident memory may grow by the model plus about one tensor, not model + mapped file."""
    path = create_random_checkpoint(tmp_path / "big", "small", hidden_size=512, intermediate_size=512,
                                    intermediate_size_mlp=1024, num_attention_heads=8, head_dim=64)
    probe = Path(__file__).with_name("peak_rss_while_loading.py")
    result = subprocess.run([sys.executable, str(probe), str(path)], capture_output=True, text=True, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["model_bytes"] > 100e6  # large enough that interpreter noise cannot hide a doubling
    assert figures["peak_growth_bytes"] <= 1.3 * figures["model_bytes"], figures


def resident_fraction(path: Path) -> float:
    """The share of the file's pages in the page cache (mincore on a private mapping that is never
    touched: asking does not read anything in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapping:
        pages = -(-len(mapping) // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        start = ctypes.c_char.from_buffer(mapping)
        try:
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(len(mapping)), vector) == 0
        finally:
            del start  # the mapping cannot close while exported
    return sum(v & 1 for v in vector) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise as Linux has them")
def test_read_ahead_reads_the_files_into_the_page_cache_one_file_beyond_the_loader(tmp_path):
    files = []
    for i in range(3):
        files.append(tmp_path / f"model-{i}.safetensors")
        files[-1].write_bytes(os.urandom(3 * READ_AHEAD_BLOCK // 2))  # a whole block and half of one
        with files[-1].open("rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if any(resident_fraction(f) > 0.1 for f in files):
        pytest.skip("this kernel keeps the files cached after POSIX_FADV_DONTNEED")
    with ReadAhead(files, files_ahead=1) as read_ahead:
        wait_for(lambda: resident_fraction(files[1]) == 1.0, 30, "the first two files read ahead")
        assert resident_fraction(files[0]) == 1.0
        time.sleep(0.5)
        assert resident_fraction(files[2]) < 0.1  # the loader is still on the first file
        read_ahead.file_done()
        wait_for(lambda: resident_fraction(files[2]) == 1.0, 30, "the third file, once the first was loaded")
    read_ahead.thread.join(10)
    assert not read_ahead.thread.is_alive()


def test_a_load_that_fails_stops_its_read_ahead(checkpoint):
    _rewrite_tensors(checkpoint, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="missing tensor lm_head.weight"):
        load_model(checkpoint)
    wait_for(lambda: not any(t.name == "warpspec-read-ahead" for t in threading.enumerate()), 10,
             "the read-ahead thread to end")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_cpu_parameters_are_advised_to_take_huge_pages():
    """The kernel marks a range advised MADV_HUGEPAGE with "hg" in its mapping's VmFlags."""
    module = torch.nn.Module()
    module.big = torch.nn.Parameter(torch.empty(4 << 20, dtype=torch.bfloat16), requires_grad=False)  # 8 MiB
    module.small = torch.nn.Parameter(torch.empty(16), requires_grad=False)
    advise_huge_pages(module)
    assert "hg" in vm_flags(module.big.data_ptr() + (4 << 20))


def vm_flags(address: int) -> list[str]:
    """/proc/self/smaps' VmFlags of the mapping that holds address."""
    holds = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            holds = start <= address < end
        elif holds and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
