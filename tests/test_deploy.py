"""deploy/: every kustomization builds (`kubectl kustomize`, offline) into resources that validate strictly
against the Kubernetes schemas (kubernetes-validate), and what the manifests assume of the server holds: the
probe path, the port, the metric the autoscaler reads, a grace period that covers the drain, the container's
entry point and its SageMaker label. The multi-host overlay's LeaderWorkerSet is a CRD the validator does not
know: its leader and worker pod templates validate as PodTemplates."""
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from jaxstream import distributed
from jaxstream.engine.metrics import EngineMetrics
from jaxstream.serving import app
from jaxstream.serving.metrics import ServerMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUSTOMIZATIONS = ["k8s/base", "k8s/overlays/gpu", "k8s/overlays/tpu"]
KUBERNETES_VERSION = "1.31.0"


def _kustomize(kustomization: str) -> subprocess.CompletedProcess:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is required to build the kustomizations (apt-get install kubernetes-client)"
    return subprocess.run([kubectl, "kustomize", str(DEPLOY / kustomization)], check=True, capture_output=True,
                          text=True)


def _build(kustomization: str) -> list[dict]:
    return [resource for resource in yaml.safe_load_all(_kustomize(kustomization).stdout) if resource]


@pytest.mark.parametrize("kustomization", [*KUSTOMIZATIONS, "k8s/overlays/tpu-multihost"])
def test_kustomizations_use_no_deprecated_fields(kustomization):
    """kubectl kustomize warns on stderr about fields it will drop (commonLabels, patchesStrategicMerge)."""
    assert "deprecated" not in _kustomize(kustomization).stderr


# Repository paths as the deploy files' comments name them ("deploy/k8s/...", "benchmarks/serve_load.py"); not
# container paths such as /models/hf.
_REPOSITORY_PATH = re.compile(r"(?<![\w/.-])(?:deploy|benchmarks|jaxstream|serving|tests|tpu_kernels|examples)"
                              r"/[\w./*-]*[\w*]")


def test_the_deploy_files_name_paths_that_exist():
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file():
            for named in _REPOSITORY_PATH.findall(path.read_text()):
                assert any(DEPLOY.parent.glob(named)), f"{path.relative_to(DEPLOY.parent)} names {named}"


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def resources(request):
    return {resource["kind"]: resource for resource in _build(request.param)}


def test_every_resource_validates_strictly(resources):
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= set(resources)
    for resource in resources.values():
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_the_adapter_rule_validates_and_names_the_metric():
    [config_map] = yaml.safe_load_all((DEPLOY / "k8s" / "prometheus-adapter-rules.yaml").read_text())
    kubernetes_validate.validate(config_map, KUBERNETES_VERSION, strict=True)
    [rule] = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == "jaxstream_engine_sessions"


class _Engine:
    healthy = True

    def metrics(self):
        return EngineMetrics(sessions=3, waiting=0, running=3, parked=0, evicted=0, pages_used={}, pages_total={},
                             host_offload_bytes=0, evictions=0, ticks=0, recent_tick_seconds=(), max_sessions=64)


def test_the_autoscaler_reads_a_metric_the_server_exports(resources):
    [metric] = resources["HorizontalPodAutoscaler"]["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    metrics = ServerMetrics()
    metrics.attach_engine(_Engine())
    assert f"\n{name} 3.0\n" in generate_latest(metrics.registry).decode()


def test_probes_port_and_grace_period_match_the_server(resources):
    pod = resources["Deployment"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    [port] = container["ports"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert int(env["PORT"]) == port["containerPort"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in app.HEALTH_PATHS
    args = container["args"]
    drain = float(args[args.index("--drain-timeout") + 1])
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + app.CLOSE_WAIT_S
    # Pods resolve as <pod>.<subdomain> only through a headless Service of that name.
    services = [r for r in _build("k8s/base") if r["kind"] == "Service"]
    assert any(s["metadata"]["name"] == pod["subdomain"] and s["spec"]["clusterIP"] == "None" for s in services)


def _dockerfile_instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    lines = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    return [part.strip() for part in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if part.strip()]


def test_the_image_has_the_compiler_the_cpu_kernel_builds_with():
    """The C++ ring attention kernel is compiled on first use for the CPU it runs on (-march=native, so not at
    build time) with $CXX, c++ or g++ (tpu_kernels/ring_attention/cpu.py); without one every CPU engine in
    the container took the slower XLA path."""
    installed = set()
    for instruction in _dockerfile_instructions():
        if instruction.startswith("RUN ") and "apt-get install" in instruction:
            command = instruction.split("apt-get install", 1)[1].split("&&", 1)[0]
            installed |= {word for word in command.split() if not word.startswith("-")}
    assert installed & {"g++", "build-essential"}, installed


def test_dockerfile_label_and_sources():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "LABEL com.amazonaws.sagemaker.capabilities.bidirectional-streaming=true" in dockerfile
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (DEPLOY.parent / source).exists(), source


@pytest.fixture
def fake_jaxstream(tmp_path):
    """A `jaxstream` on PATH that prints the arguments it was run with."""
    script = tmp_path / "jaxstream"
    script.write_text('#!/bin/sh\necho "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return tmp_path


SAGEMAKER_MODEL_DIR = "/opt/ml/model"  # where SageMaker hosting unpacks a model's artifacts


@pytest.fixture
def entrypoint(tmp_path):
    """entrypoint.sh with SageMaker's model directory moved to {model}, a folder of the test's (absent until
    a test makes it): the host running the tests has no /opt/ml."""
    assert not Path(SAGEMAKER_MODEL_DIR).exists(), "this host looks like a SageMaker container"
    script = tmp_path / "entrypoint.sh"
    text = (DEPLOY / "entrypoint.sh").read_text()
    assert SAGEMAKER_MODEL_DIR in text
    script.write_text(text.replace(SAGEMAKER_MODEL_DIR, str(tmp_path / "model")))
    return script


# AWS's contract for bring-your-own inference containers: SageMaker runs `docker run IMAGE serve` (no other
# arguments), sends requests to port 8080 and puts the model's artifacts in /opt/ml/model.
@pytest.mark.parametrize("environ, model_files, argv, expected", [
    ({}, None, ["serve"], "serve --host 0.0.0.0 --port 8000"),
    ({"PORT": "9000"}, None, ["serve", "some/model"], "serve --host 0.0.0.0 --port 9000 some/model"),
    ({}, None, ["transcribe", "a.wav"], "transcribe a.wav"),
    # SageMaker hosting: the model directory exists, with a checkpoint or (no ModelDataUrl) empty.
    ({}, ["config.json"], ["serve"], "serve --host 0.0.0.0 --port 8080 {model}"),
    ({}, [], ["serve"], "serve --host 0.0.0.0 --port 8080"),
    ({}, ["config.json"], ["serve", "other/model"], "serve --host 0.0.0.0 --port 8080 other/model"),
    ({"PORT": "9000"}, ["config.json"], ["serve"], "serve --host 0.0.0.0 --port 8080 {model}"),
    ({"SAGEMAKER_BIND_TO_PORT": "9090"}, ["config.json"], ["serve"], "serve --host 0.0.0.0 --port 9090 {model}"),
    ({"SAGEMAKER_BIND_TO_PORT": "8080"}, None, ["serve"], "serve --host 0.0.0.0 --port 8080"),
    ({"SM_MODEL_DIR": "/opt/ml/model"}, None, ["serve"], "serve --host 0.0.0.0 --port 8080"),
    ({"SM_MODEL_DIR": "{model}"}, ["config.json"], ["serve"], "serve --host 0.0.0.0 --port 8080 {model}"),
    # A checkpoint is what models/checkpoint_metadata.py's inspect_checkpoint recognises: params.json (Mistral native),
    # config.json (Hugging Face), jaxstream.json (jaxstream Orbax). Anything else is not one (`jaxstream serve DIR`
    # fails on it): a model tarball holding only code (SageMaker's framework toolkits' code/inference.py) was
    # passed as the model all the same.
    ({}, ["params.json", "consolidated.safetensors"], ["serve"], "serve --host 0.0.0.0 --port 8080 {model}"),
    ({}, ["jaxstream.json"], ["serve"], "serve --host 0.0.0.0 --port 8080 {model}"),
    ({}, ["code/inference.py"], ["serve"], "serve --host 0.0.0.0 --port 8080"),
    ({}, ["model.tar.gz", "README.md"], ["serve"], "serve --host 0.0.0.0 --port 8080"),
    ({"SM_MODEL_DIR": "{model}"}, ["code/inference.py"], ["serve"], "serve --host 0.0.0.0 --port 8080"),
])
def test_entrypoint(fake_jaxstream, entrypoint, tmp_path, environ, model_files, argv, expected):
    model = tmp_path / "model"
    if model_files is not None:
        model.mkdir()
        for name in model_files:
            (model / name).parent.mkdir(parents=True, exist_ok=True)
            (model / name).write_text("{}")
    env = {"PATH": f"{fake_jaxstream}{os.pathsep}{os.environ['PATH']}",
           **{key: value.format(model=model) for key, value in environ.items()}}
    result = subprocess.run(["sh", str(entrypoint), *argv], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == expected.format(model=model)
    # A model directory that holds files but no checkpoint is worth a line in the endpoint's log.
    skipped = bool(model_files) and argv == ["serve"] and "{model}" not in expected
    assert ("holds no checkpoint" in result.stderr) == skipped, result.stderr


# -- one engine over a multi-host TPU slice: a LeaderWorkerSet (a CRD kubernetes-validate does not know) ------

@pytest.fixture(scope="module")
def multihost():
    return {resource["kind"]: resource for resource in _build("k8s/overlays/tpu-multihost")}


def test_multihost_resources_and_pod_templates_validate_strictly(multihost):
    assert set(multihost) == {"LeaderWorkerSet", "Service", "HorizontalPodAutoscaler"}
    kubernetes_validate.validate(multihost["Service"], KUBERNETES_VERSION, strict=True)
    kubernetes_validate.validate(multihost["HorizontalPodAutoscaler"], KUBERNETES_VERSION, strict=True)
    group = multihost["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    for name in ("leaderTemplate", "workerTemplate"):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                                      "template": group[name]}, KUBERNETES_VERSION, strict=True)


def test_multihost_group_matches_the_server(multihost):
    lws = multihost["LeaderWorkerSet"]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost process ends the engine
    leader_pod, worker_pod = group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]
    [leader], [worker] = leader_pod["containers"], worker_pod["containers"]
    assert leader["args"] == worker["args"] and leader["image"] == worker["image"]  # one job, one program
    # One pod per host of the slice, each with the host's chips.
    rows, columns = map(int, leader_pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x"))
    chips = int(leader["resources"]["limits"]["google.com/tpu"])
    assert group["size"] * chips == rows * columns
    env = {item["name"]: item.get("value") for item in leader["env"]}
    worker_env = {item["name"]: item.get("value") for item in worker["env"]}
    assert int(env["JAXSTREAM_COORDINATOR_PORT"]) == int(worker_env["JAXSTREAM_COORDINATOR_PORT"]) == \
        distributed.DEFAULT_COORDINATOR_PORT
    ports = {port["name"]: port["containerPort"] for port in leader["ports"]}
    assert ports == {"http": int(env["PORT"]), "coordinator": int(env["JAXSTREAM_COORDINATOR_PORT"])}
    assert ports["coordinator"] != 8476  # TPU_PROCESS_PORT, which LWS gives libtpu on TPU pods
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe]["httpGet"]["path"] in app.HEALTH_PATHS
        assert probe not in worker  # workers serve no HTTP
    args = leader["args"]
    drain = float(args[args.index("--drain-timeout") + 1])
    pre_stop = float(leader["lifecycle"]["preStop"]["exec"]["command"][-1])
    for pod in (leader_pod, worker_pod):  # workers must outlive the leader's drain
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + app.CLOSE_WAIT_S
    # The Service reaches leaders only; the autoscaler scales whole groups.
    assert multihost["Service"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    target = multihost["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("LeaderWorkerSet", lws["metadata"]["name"])
    [metric] = multihost["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "jaxstream_engine_sessions"
