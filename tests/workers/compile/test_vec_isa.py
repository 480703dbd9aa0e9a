"""workers/compile/vec_isa.py: inductor's instruction-set probe runs once per host, in real processes.

Each "start" is a Python process of its own, as a worker or coordinator is: inductor keeps a probe's
answer for its process, so only a new process shows whether it probes. The suite's inductor folder
holds the probe's builds once any test compiled, so a probe here costs its loading processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from warpspec.workers.compile import torch_internals
from warpspec.workers.compile.vec_isa import host_facts, read_record, should_record, vec_isa_options

# A start: counts inductor's probes of a listed set (VecISA.check_build of its common program, once
# per set; AVX-512 and AMX build extra programs for their variants whatever the switch says), then
# (argv[2] == "compile") compiles a function through inductor, as a step does.
START = textwrap.dedent("""
    import json, sys
    import torch
    from torch._inductor import config, cpu_vec_isa
    from warpspec.workers.compile.vec_isa import vec_isa_options

    probes = []
    check_build = cpu_vec_isa.VecISA.check_build
    def counted(self, code):
        if code == cpu_vec_isa.VecISA._avx_code:
            probes.append(str(self))
        return check_build(self, code)
    cpu_vec_isa.VecISA.check_build = counted

    options = vec_isa_options(__import__("pathlib").Path(sys.argv[1]))
    if sys.argv[2] == "compile":
        x = torch.arange(8.0)
        assert torch.equal(torch.compile(lambda t: t * 2 + 1, options=options)(x), x * 2 + 1)
    print(json.dumps({"options": options, "probes": probes, "vec_isa_ok": config.cpp.vec_isa_ok,
                      "used": [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]}))
""")


def start(record, compile: bool = False) -> dict:
    done = subprocess.run([sys.executable, "-c", START, str(record), "compile" if compile else "-"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def listed() -> list[str]:
    names = torch_internals.listed_vec_isas()
    if not names:
        pytest.skip("this CPU lists no vector instruction set inductor knows")
    return names


def test_the_first_start_on_a_host_probes_and_records_the_next_skips_the_probe(tmp_path, listed):
    record = tmp_path / "vec-isa.json"
    first = start(record)
    assert sorted(first["probes"]) == sorted(listed)  # every listed set built (or found) and loaded
    assert first["options"] == {"cpp.vec_isa_ok": True} and first["used"] == listed
    assert read_record(record) == host_facts()  # this process's facts: same torch, compiler, CPU

    # The switch is in the options of the graphs it compiles, not the process's config.
    second = start(record, compile=True)
    assert second["probes"] == [] and second["options"] == {"cpp.vec_isa_ok": True}
    assert second["vec_isa_ok"] is None and second["used"] == first["used"]


@pytest.mark.parametrize("stale", ["compiler_stat", "not json"])  # any field: the record is compared whole
def test_a_record_from_another_compiler_or_unreadable_is_probed_again_and_replaced(tmp_path, listed, stale):
    record = tmp_path / "vec-isa.json"
    if stale == "not json":
        record.write_text("{truncated")
    else:
        facts = host_facts()
        facts[stale] = [0, 0]
        record.write_text(json.dumps(facts))
    again = start(record)
    assert sorted(again["probes"]) == sorted(listed) and again["used"] == listed
    assert read_record(record) == host_facts()


def test_only_a_probe_that_found_every_listed_set_usable_is_recorded():
    assert should_record(["amx_tile", "avx512", "avx2"], ["amx_tile", "avx512", "avx2"])
    assert not should_record(["amx_tile", "avx512", "avx2"], ["avx512", "avx2"])  # an old compiler
    assert not should_record([], [])  # nothing listed: nothing to skip


def test_a_record_that_cannot_be_written_costs_only_the_probe(tmp_path, listed, caplog):
    (tmp_path / "file").write_text("")
    record = tmp_path / "file" / "vec-isa.json"  # its folder is a file
    with caplog.at_level("INFO", logger="warpspec.workers.compile.vec_isa"):
        assert vec_isa_options(record) == {"cpp.vec_isa_ok": True}
    assert not record.exists() and "not recorded" in caplog.text
