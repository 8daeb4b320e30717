"""Multi-process jobs (jaxstream/distributed.py): where the settings come from, and `jaxstream eval --shard
auto` over two real processes joined by jax.distributed on loopback, whose merged report must equal a
one-process evaluation utterance by utterance."""
import json
import os
import socket
import subprocess
import sys
from argparse import Namespace

import numpy as np
import pytest

from jaxstream import cli, distributed
from jaxstream.errors import UserError

SENTENCES = ["the cat sat on the mat", "open the kitchen window", "please call me after lunch"]


def _args(coordinator=None, num_processes=None, process_id=None, mode=None):
    return Namespace(coordinator=coordinator, num_processes=num_processes, process_id=process_id, distributed=mode)


def test_settings_from_flags_environment_and_leaderworkerset():
    assert distributed.settings(_args(), environ={}) is None
    assert distributed.settings(_args(mode="auto"), environ={}) == {}
    expected = dict(coordinator_address="10.0.0.1:9000", num_processes=4, process_id=2)
    assert distributed.settings(_args("10.0.0.1:9000", 4, 2), environ={}) == expected
    environ = {"JAXSTREAM_COORDINATOR": "10.0.0.1:9000", "JAXSTREAM_NUM_PROCESSES": "4", "JAXSTREAM_PROCESS_ID": "2"}
    assert distributed.settings(_args(), environ=environ) == expected
    lws = {"LWS_LEADER_ADDRESS": "job-0.job.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    assert distributed.settings(_args(), environ=lws) == dict(
        coordinator_address=f"job-0.job.ns:{distributed.DEFAULT_COORDINATOR_PORT}", num_processes=2, process_id=1)
    # Flags win over the environment.
    assert distributed.settings(_args("h:1", 2, 0), environ=environ)["coordinator_address"] == "h:1"


@pytest.mark.parametrize("args, message", [
    (_args("h:1", 2), "give all three"),
    (_args("h:1", 2, 2), "process index 2 is not in 0..1"),
    (_args("host-without-port", 2, 0), "HOST:PORT"),
])
def test_bad_settings_are_one_line_errors(args, message):
    with pytest.raises(UserError, match=message):
        distributed.settings(args, environ={})
    with pytest.raises(UserError, match="must be integers"):
        distributed.settings(_args(), environ={"JAXSTREAM_COORDINATOR": "h:1", "JAXSTREAM_NUM_PROCESSES": "two",
                                               "JAXSTREAM_PROCESS_ID": "0"})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder corpus (audio + same-name .txt) of espeak-ng sentences."""
    root = tmp_path_factory.mktemp("sentences")
    for index, text in enumerate(SENTENCES):
        wav = subprocess.run(["espeak-ng", "--stdout", text], check=True, capture_output=True).stdout
        (root / f"utt{index}.wav").write_bytes(wav)
        (root / f"utt{index}.txt").write_text(text + "\n")
    return root


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_eval_shard_auto_over_two_processes_equals_one_process(corpus, tmp_path, capsys):
    assert cli.main(["eval", str(corpus), "--concurrency", "1", "--report", str(tmp_path / "one.json")]) == 0
    capsys.readouterr()

    coordinator = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    processes = [subprocess.Popen(
        [sys.executable, "-m", "jaxstream", "eval", str(corpus), "--concurrency", "1", "--shard", "auto",
         "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(index),
         "--report", str(tmp_path / "two.json")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for index in range(2)]
    outputs = [process.communicate(timeout=600) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    assert "WER" in outputs[0][0] and outputs[1][0] == ""  # only process 0 prints the merged table

    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    parts = [json.loads((tmp_path / f"two.part-{i}-of-2.json").read_text()) for i in range(2)]
    assert sorted(len(part["runs"][0]["utterances"]) for part in parts) == [1, 2]  # each process ran its part
    by_id = lambda report: {u["id"]: u["hypothesis"] for u in report["runs"][0]["utterances"]}  # noqa: E731
    assert by_id(two) == by_id(one)
    assert len(by_id(one)) == len(SENTENCES)
    assert np.isclose(two["runs"][0]["summary"]["wer"], one["runs"][0]["summary"]["wer"])
