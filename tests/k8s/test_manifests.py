"""k8s/ and deploy/serve_config.yaml: valid for KubeRay's CRD and Ray Serve's config schema, importable,
and consistent with each other (ports, probes, GPUs per replica, replica bounds, volumes, image).

The CRD schemas live beside the repository in ../shared/schemas (KubeRay, Apache-2.0); without them the
CRD checks skip and the rest still runs.
"""

import copy
import fnmatch
import importlib
import importlib.util
import json
import re
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema, gRPCOptionsSchema

from helpers.grafana_dashboard import DASHBOARD, dashboard_metrics
from helpers.private_cluster import run_on_private_cluster
from warpspec.serving.grpc_service import LIVENESS_SERVICE_NAME, READINESS_SERVICE_NAMES
from warpspec.serving.serve_cli import free_local_port

REPO = Path(__file__).parents[2]
SCHEMAS = REPO.parent / "shared" / "schemas"
CRD_FILES = {"RayService": "kuberay-rayservice-crd.yaml", "RayCluster": "kuberay-raycluster-crd.yaml"}
SERVE_CONFIG = REPO / "deploy" / "serve_config.yaml"
# Builder args that size one deployment (paths, GPUs, precision, capacity); every other key and value of
# the two Serve configs must be the same.
DEPLOYMENT_SPECIFIC_ARGS = {"model", "draft", "num_workers", "dtype", "device", "kv_cache_memory_gib",
                            "max_model_len", "min_replicas", "max_replicas", "target_ongoing_requests",
                            "placement_timeout_s", "compile_cache"}

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB each: libyaml parses them in 1 s


def load_manifests() -> list[tuple[str, dict]]:
    """(file:index, document) for every non-empty YAML document under k8s/."""
    docs = []
    for path in sorted([*(REPO / "k8s").glob("*.yaml"), *(REPO / "k8s").glob("*.yml")]):
        for i, doc in enumerate(yaml.load_all(path.read_text(), Loader=Loader)):
            if doc is not None:
                docs.append((f"{path.name}:{i}", doc))
    return docs


MANIFESTS = load_manifests()
RAY_SERVICES = [(name, doc) for name, doc in MANIFESTS if doc.get("kind") == "RayService"]


def strict(schema: dict) -> dict:
    """The CRD's openAPIV3Schema as JSON Schema that rejects unknown fields, as the API server does under
    strict field validation (kubectl's default); plain jsonschema would let a misspelt field through, and
    Kubernetes would then drop it silently.

    int-or-string fields (`x-kubernetes-int-or-string`, e.g. quantities: 8 or "8" or "1200Gi") come as
    `anyOf: [integer, string]` plus a pattern that applies to strings only, which jsonschema already
    reads right; one without the anyOf gets it here."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out and "type" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


int32 = jsonschema.FormatChecker()
int32.checks("int32")(lambda v: not isinstance(v, int) or -2**31 <= v < 2**31)


@cache
def crd_validator(kind: str, api_version: str) -> jsonschema.Draft7Validator:
    path = SCHEMAS / CRD_FILES[kind]
    if not path.exists():
        pytest.skip(f"{path} is absent: the KubeRay CRD schemas sit beside the repository in ../shared/schemas")
    crd = yaml.load(path.read_text(), Loader=Loader)
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group, f"{api_version}: the CRD in {path.name} is for group {crd['spec']['group']}"
    versions = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    assert version in versions, f"{api_version}: {path.name} serves only {sorted(versions)}"
    return jsonschema.Draft7Validator(strict(versions[version]["schema"]["openAPIV3Schema"]), format_checker=int32)


def crd_errors(doc: dict) -> list[str]:
    errors = crd_validator(doc["kind"], doc["apiVersion"]).iter_errors(doc)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def serve_config_of(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def ray_containers(rayservice: dict) -> dict[str, dict]:
    """Group name ("head" or a worker groupName) -> its Ray container (KubeRay's is the first one)."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]} | {g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])}
    return {name: g["template"]["spec"]["containers"][0] for name, g in groups.items()}


def gpu_groups(rayservice: dict) -> list[dict]:
    groups = rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])
    return [g for g in groups if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]]


def named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def test_every_manifest_is_a_named_kubernetes_object():
    assert RAY_SERVICES, "k8s/ holds no RayService"
    for name, doc in MANIFESTS:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{name}: not a Kubernetes object"
        assert doc["metadata"].get("name"), f"{name}: metadata.name is missing"


@pytest.mark.parametrize("name, doc", [(n, d) for n, d in MANIFESTS if d["kind"] in CRD_FILES])
def test_kuberay_objects_validate_against_the_crd(name, doc):
    assert crd_errors(doc) == [], f"{name} does not validate against the KubeRay CRD"


# Each mistake is one a person could make in k8s/rayservice.yaml; the validator must name the field.
BROKEN = {
    "worker group without groupName": (lambda s: s["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"),
                                       "'groupName' is a required property"),
    "replica bound as a string": (lambda s: s["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas="4"),
                                  "'4' is not of type 'integer'"),
    "rayStartParams value not a string": (lambda s: s["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
                                          .update({"num-cpus": 0}), "0 is not of type 'string'"),
    "quantity that is not a quantity": (lambda s: gpu_container(s)["resources"]["limits"].update({"memory": "lots"}),
                                        "'lots' does not match"),
    "fractional GPU count": (lambda s: gpu_container(s)["resources"]["limits"].update({"nvidia.com/gpu": 0.5}),
                             "0.5 is not valid under any of the given schemas"),
    "misspelt field": (lambda s: s["rayClusterConfig"].update(enableInTreeAutoscalling=True),
                       "'enableInTreeAutoscalling' was unexpected"),
    "unknown autoscaler mode": (lambda s: s["rayClusterConfig"]["autoscalerOptions"].update(upscalingMode="Fast"),
                                "'Fast' is not one of"),
    "port beyond int32": (lambda s: gpu_container(s)["ports"][0].update(containerPort=2**31), "is not a 'int32'"),
}


def gpu_container(spec: dict) -> dict:
    return spec["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("mistake", BROKEN)
def test_the_crd_validator_rejects_a_broken_rayservice(mistake):
    # Without this a validator that accepted anything (a wrong schema path, an empty schema) would pass.
    name, doc = RAY_SERVICES[0]
    broken = copy.deepcopy(doc)
    break_it, expected = BROKEN[mistake]
    break_it(broken["spec"])
    errors = crd_errors(broken)
    assert any(expected in e for e in errors), f"{name} with a {mistake}: expected {expected!r}, got {errors}"


def assert_known_keys(model, data: dict, where: str):
    # Serve's schemas ignore unknown keys (forward compatibility), so a typo such as `grpc_option` would
    # silently fall back to defaults.
    unknown = set(data) - set(model.model_fields)
    assert not unknown, f"{where}: {sorted(unknown)} are not fields of {model.__name__}"


def serve_configs() -> list[tuple[str, dict]]:
    return [("deploy/serve_config.yaml", yaml.safe_load(SERVE_CONFIG.read_text()))] + [
        (f"{name} serveConfigV2", serve_config_of(doc)) for name, doc in RAY_SERVICES]


SERVE_CONFIGS = serve_configs()


@pytest.mark.parametrize("where, config", SERVE_CONFIGS, ids=[where for where, _ in SERVE_CONFIGS])
def test_serve_config_validates_against_ray_serve_schema(where, config):
    ServeDeploySchema.model_validate(config)
    assert_known_keys(ServeDeploySchema, config, where)
    assert_known_keys(HTTPOptionsSchema, config.get("http_options", {}), f"{where} http_options")
    assert_known_keys(gRPCOptionsSchema, config.get("grpc_options", {}), f"{where} grpc_options")
    for app in config["applications"]:
        assert_known_keys(ServeApplicationSchema, app, f"{where} application {app.get('name')}")
    assert "warpspec.serving.grpc_servicers.add_HealthServicer_to_server" in \
        config["grpc_options"]["grpc_servicer_functions"], f"{where}: the gRPC probes need the health service"


def import_object(path: str):
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("where, config", SERVE_CONFIGS, ids=[where for where, _ in SERVE_CONFIGS])
def test_serve_config_names_importable_objects_and_args_the_builder_takes(where, config):
    from ray.serve import Application

    from warpspec.serving.serve_config import GRPC_SERVICER_FUNCTIONS

    servicers = config["grpc_options"]["grpc_servicer_functions"]
    for path in servicers:
        assert callable(import_object(path)), f"{where}: {path} is not callable"
    assert set(GRPC_SERVICER_FUNCTIONS) <= set(servicers), f"{where}: the application serves {GRPC_SERVICER_FUNCTIONS}"
    for app in config["applications"]:
        # Binding only records the deployment's options and arguments: no Ray, no model loaded. An
        # unknown or mistyped arg is refused here, as it would be on the cluster.
        built = import_object(app["import_path"])(app["args"])
        assert isinstance(built, Application), f"{where}: {app['import_path']} did not build a Serve application"
        # Serve refuses overrides for deployments the application does not have, but only once deployed.
        for override in app.get("deployments", []):
            assert override["name"] == built._bound_deployment.name, \
                f"{where}: override for {override['name']!r}, the application deploys {built._bound_deployment.name!r}"


@pytest.mark.parametrize("name, doc", RAY_SERVICES)
def test_embedded_serve_config_agrees_with_deploy_file(name, doc):
    ours, theirs = yaml.safe_load(SERVE_CONFIG.read_text()), serve_config_of(doc)
    for config in (ours, theirs):
        for app in config["applications"]:
            app.pop("deployments", None)  # per-node placement overrides belong to the cluster
            app["args"] = {k: v for k, v in app["args"].items() if k not in DEPLOYMENT_SPECIFIC_ARGS} | {
                k: "<deployment-specific>" for k in app["args"].keys() & DEPLOYMENT_SPECIFIC_ARGS}
    assert theirs == ours, f"{name} serveConfigV2 and deploy/serve_config.yaml differ beyond deployment sizing"


@pytest.mark.parametrize("name, doc", RAY_SERVICES)
def test_ports_and_probes_line_up_with_the_serve_config(name, doc):
    config = serve_config_of(doc)
    http_port, grpc_port = config["http_options"]["port"], config["grpc_options"]["port"]
    for group, container in ray_containers(doc).items():
        ports = named_ports(container)
        assert ports.get("serve") == http_port, f"{name} {group}: container port 'serve' must be {http_port}"
        assert ports.get("grpc") == grpc_port, f"{name} {group}: container port 'grpc' must be {grpc_port}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "grpc" in container.get(probe, {}):
                assert container[probe]["grpc"]["port"] == grpc_port, f"{name} {group} {probe}"
    for group in gpu_groups(doc):
        container = group["template"]["spec"]["containers"][0]
        for probe in ("readinessProbe", "livenessProbe"):
            assert "grpc" in container.get(probe, {}), f"{name} {group['groupName']}: {probe} must use gRPC health"
        # Readiness asks whether the replica serves now; liveness whether it can recover by itself
        # (a rebuilding replica is not ready but alive: restarting its pod would lose the rebuild).
        assert container["livenessProbe"]["grpc"].get("service") == LIVENESS_SERVICE_NAME, \
            f"{name}: the liveness probe must ask the liveness service"
        for probe in ("startupProbe", "readinessProbe"):
            assert container[probe]["grpc"].get("service", "") in READINESS_SERVICE_NAMES, f"{name} {probe}"
    for svc_name, svc in MANIFESTS:
        if svc["kind"] == "Service":
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                assert target in (grpc_port, http_port, "grpc", "serve"), f"{svc_name}: targets unknown port {target}"


@pytest.mark.parametrize("name, doc", RAY_SERVICES)
def test_one_replica_fills_one_gpu_pod_and_the_autoscaler_bounds_cover_serve(name, doc):
    cluster = doc["spec"]["rayClusterConfig"]
    args = serve_config_of(doc)["applications"][0]["args"]
    assert cluster["enableInTreeAutoscaling"] is True, f"{name}: Serve autoscaling needs the Ray autoscaler"
    head_limits = ray_containers(doc)["head"]["resources"]["limits"]
    assert "nvidia.com/gpu" not in head_limits, f"{name}: the head must not hold GPUs"
    groups = gpu_groups(doc)
    assert len(groups) == 1, f"{name}: expected one GPU worker group, got {len(groups)}"
    group = groups[0]
    resources = group["template"]["spec"]["containers"][0]["resources"]
    gpus = int(resources["limits"]["nvidia.com/gpu"])
    assert int(resources["requests"]["nvidia.com/gpu"]) == gpus, f"{name}: GPU requests must equal limits"
    # num_workers shards = one GPU each = the whole pod: a replica never spans nodes or shares one.
    assert args["num_workers"] == gpus, f"{name}: num_workers {args['num_workers']} != {gpus} GPUs per pod"
    assert group["minReplicas"] <= args["min_replicas"], f"{name}: idle GPU pods below Serve's min_replicas"
    assert group["maxReplicas"] >= args["max_replicas"], f"{name}: too few GPU pods for Serve's max_replicas"
    # Otherwise two replicas could share a node and leave another GPU pod without a proxy for its probes.
    overrides = serve_config_of(doc)["applications"][0].get("deployments", [])
    assert [o.get("max_replicas_per_node") for o in overrides] == [1], f"{name}: one replica per node"


@pytest.mark.parametrize("name, doc", RAY_SERVICES)
def test_checkpoints_come_from_a_read_only_volume_and_shm_is_memory(name, doc):
    args = serve_config_of(doc)["applications"][0]["args"]
    cluster = doc["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in
                                                             cluster["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: m for m in pod["containers"][0].get("volumeMounts", [])}
        for key in ("model", "draft"):
            if args.get(key):
                mount = next((m for p, m in mounts.items() if args[key].startswith(p.rstrip("/") + "/")), None)
                assert mount is not None, f"{name}: {key} {args[key]} is on no mounted volume"
                assert mount.get("readOnly") is True, f"{name}: {mount['mountPath']} must be mounted read-only"
                assert "persistentVolumeClaim" in volumes[mount["name"]], f"{name}: {key} volume is not a PVC"
        shm = mounts.get("/dev/shm")
        assert shm and volumes[shm["name"]].get("emptyDir", {}).get("medium") == "Memory", \
            f"{name}: /dev/shm must be an in-memory emptyDir (Ray's object store and NCCL live there)"


@pytest.mark.parametrize("name, doc", RAY_SERVICES)
def test_every_gpu_pod_writes_the_compile_cache_to_one_shared_volume(name, doc):
    folder = serve_config_of(doc)["applications"][0]["args"].get("compile_cache")
    assert folder, f"{name}: no compile_cache: every new replica compiles its steps again"
    shared_claims = {m["metadata"]["name"] for _, m in MANIFESTS
                     if m["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in m["spec"]["accessModes"]}
    for group in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mount = next((m for m in pod["containers"][0]["volumeMounts"]
                      if folder.startswith(m["mountPath"].rstrip("/") + "/")), None)
        assert mount is not None and not mount.get("readOnly"), f"{name}: {folder} is on no writable mount"
        claim = volumes[mount["name"]].get("persistentVolumeClaim", {}).get("claimName")
        assert claim in shared_claims, f"{name}: {folder} is not on a ReadWriteMany claim"


def test_image_matches_dockerfile_and_dockerignore_keeps_the_package():
    dockerfile = (REPO / "Dockerfile").read_text()
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)", dockerfile, re.M).group(1)
    for name, doc in RAY_SERVICES:
        assert doc["spec"]["rayClusterConfig"]["rayVersion"] == ray_version, f"{name}: rayVersion != Dockerfile's"
        images = {c["image"] for c in ray_containers(doc).values()}
        assert len(images) == 1, f"{name}: Ray pods must run one image, got {sorted(images)}"
    # pip install . needs these; one matched by a .dockerignore pattern would break the image build.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = ["pyproject.toml", "README.md", *pyproject["tool"]["setuptools"]["package-dir"].values()]
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith(("#", "!"))]
    for path in needed:
        hits = [p for p in patterns if fnmatch.fnmatch(path, p.rstrip("/"))]
        assert not hits, f".dockerignore excludes {path} (pattern {hits[0]}), which `pip install .` needs"



@pytest.mark.slow
def test_serve_config_file_deploys_and_answers_grpc_health_and_http():
    # deploy/serve_config.yaml as `serve deploy` runs it (the controller builds import_path with args),
    # on the bundled model pair it names: what the k8s probes and clients rely on, minus the GPUs.
    report = run_on_private_cluster(Path(__file__).with_name("deploy_config.py"),
                                    [str(SERVE_CONFIG), str(free_local_port()), str(free_local_port())],
                                    f"deploying {SERVE_CONFIG.name}", 360, cwd=REPO)
    assert report["status"] == "RUNNING", f"{SERVE_CONFIG.name} failed to deploy: {report['message'][-2000:]}"
    assert report["health"] == "SERVING" and report["liveness"] == "SERVING"
    assert report["num_generated"] >= 1
    assert report["models"] == ["tiny-maverick"]  # the checkpoint folder's name


def test_the_grafana_dashboard_reads_only_metrics_that_are_exported():
    """Every warpspec series a panel reads is one serving/metrics.py defines (Ray exports it with a ray_
    prefix), and the replica count is Serve's own gauge; the live names are checked on Ray's endpoint
    in tests/serving/test_metrics.py."""
    source = (REPO / "cluster" / "serving" / "metrics.py").read_text()
    names = re.findall(r'metrics\.(?:Gauge|Counter|Histogram)\(\s*"(warpspec_\w+)"', source)
    defined = {f"ray_{name}" for name in names}
    read = dashboard_metrics()
    assert read - defined == {"ray_serve_deployment_replica_healthy"}
    # The panels an operator asks for first: latency percentiles, throughput, queue, KV use, prefix hits,
    # acceptance by position, replicas.
    assert {"ray_warpspec_time_to_first_token_seconds", "ray_warpspec_time_per_output_token_seconds",
            "ray_warpspec_generation_tokens_total", "ray_warpspec_num_waiting_requests",
            "ray_warpspec_kv_cache_usage_ratio", "ray_warpspec_prefix_cache_hit_rate",
            "ray_warpspec_spec_decode_accepted_tokens_total"} <= read
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels) and all(panel["targets"] for panel in panels)
