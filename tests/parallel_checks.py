"""The pieces of ppokit.process.parallel, checked under `torchrun --nproc_per_node N` (gloo, CPU) or as one plain
process. tests/test_multiprocess.py launches this file and asserts on what it writes; run by hand:

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 tests/parallel_checks.py OUT_DIR [LOAD_DIR]

Every process builds the same tiny Llama policy and critic from one seed and feeds its own rows. The
main process writes OUT_DIR/results.json and the saved models; a DCP checkpoint goes to OUT_DIR/dcp.
With LOAD_DIR (a previous OUT_DIR written with another process count) it also loads LOAD_DIR/dcp into
a sharded model and compares the weights with LOAD_DIR's consolidated save (DCP resharding).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from accelerate import Accelerator  # noqa: E402

from ppokit.models import adapters, roles  # noqa: E402

from ppokit.process import parallel  # noqa: E402
from ppokit.config.schema import LoraConfig, ParallelConfig, PPOConfig  # noqa: E402
from ppokit.training.guards import UpdateSnapshot  # noqa: E402
from ppokit.models.forwards import response_logits, response_logprobs  # noqa: E402
from ppokit.models.loading import enable_gradient_checkpointing, value_model_from_policy  # noqa: E402
from ppokit.engines.base import Request, Sampling, complete  # noqa: E402
from ppokit.engines.hf import HFEngine, HFSampler  # noqa: E402
from ppokit.demos.tiny import tiny_causal_lm, tiny_config, word_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from ppokit.training.optimise import PolicyAndValue  # noqa: E402
from ppokit.models.prefix import SharedPrefix  # noqa: E402

WORDS = "the a good bad movie film was is great awful fine plot actors story long short".split()
STEPS = 3
RESPONSE = 5


def build(tokenizer, lora: bool = False, checkpointing: bool = False) -> PolicyAndValue:
    torch.manual_seed(0)
    policy = tiny_causal_lm("llama", tokenizer, hidden=32, layers=2, heads=4)
    value = value_model_from_policy(policy)
    torch.nn.init.normal_(value.score.weight, std=0.1)  # a zero head would give the critic no gradient at step 1
    if lora:
        config = PPOConfig(lora=LoraConfig(r=4, alpha=8))
        value = adapters.add_value_adapter(value, config.lora)
        policy = adapters.add_policy_adapter(policy, config.lora)
        with torch.no_grad():  # peft starts B at zero: make the adapter change the output from step 1
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
    if checkpointing:
        enable_gradient_checkpointing(policy)
        enable_gradient_checkpointing(value)
    return PolicyAndValue(policy, value)


def build_shared_critic(tokenizer) -> PolicyAndValue:
    """A LoRA policy and the critic on its own base (value_model: shared): adapter `value` and a scalar head."""
    torch.manual_seed(0)
    lora = PPOConfig(lora=LoraConfig(r=4, alpha=8)).lora
    policy = adapters.add_policy_adapter(tiny_causal_lm("llama", tokenizer, hidden=32, layers=2, heads=4), lora)
    critic = adapters.SharedBaseCritic(policy, lora)
    with torch.no_grad():  # peft starts B at zero, the critic's head is zero: make both adapters and the head matter from step 1
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
        critic.score.weight.normal_(std=0.1)
    return PolicyAndValue(policy, critic)


@contextlib.contextmanager
def set_adapter_resharding():
    """peft's PeftModel.set_adapter resharding every FSDP unit of the model before it switches, as peft 0.22 does
    (`PeftModel._reshard_fsdp_modules`), whichever peft is installed."""
    from peft import PeftModel
    from torch.distributed.fsdp import FSDPModule

    original = PeftModel.set_adapter

    def set_adapter(self, *args, **kwargs):
        for module in self.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return original(self, *args, **kwargs)

    PeftModel.set_adapter = set_adapter
    try:
        yield
    finally:
        PeftModel.set_adapter = original


def shared_critic(ddp, fsdp, tokenizer, ids, mask) -> dict:
    """The shared critic under fsdp: it switches to its adapter and back inside the training forward. FSDP keeps the
    policy's root unit (embeddings, final norm, tied head) gathered from the forward to the backward; after the critic's
    forward it must still be (a reshard there frees weights the backward reads: a segmentation fault on CPU). Then
    STEPS steps of both roles equal ddp's."""
    with set_adapter_resharding():
        model, optimizer, _ = fsdp.prepare(build_shared_critic(tokenizer), adamw)
        values = model(ids, mask, ids[:, -RESPONSE:], mask[:, -RESPONSE:].bool(), 1.0, part="value")[2]
        gathered = not isinstance(model.policy.get_base_model().model.norm.weight, DTensor)
        if not gathered:  # its backward would read freed memory
            return {"root_gathered_after_critic_forward": False}
        values.sum().backward()
        model.zero_grad(set_to_none=True)
        norms = [one_step(fsdp, model, optimizer, ids, mask) for _ in range(STEPS)]
        replicated, _, ddp_norms = train(ddp, build_shared_critic(tokenizer), ids, mask)
    initial = build_shared_critic(tokenizer).state_dict()
    fsdp_weights, ddp_weights = full_weights(fsdp, model), full_weights(ddp, replicated)
    moved = {k for k in initial if k in ddp_weights and not torch.equal(ddp_weights[k], initial[k])}
    return {"root_gathered_after_critic_forward": True, "fsdp_grad_norms": norms, "ddp_grad_norms": ddp_norms,
            "max_weight_difference": max_difference(ddp_weights, fsdp_weights) if ddp_weights else None,
            "critic_adapter_moved": any(".value." in k for k in moved), "critic_head_moved": "value_model.score.weight" in moved}


def rows(tokenizer, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)  # each process its own rows
    ids = torch.randint(4, len(tokenizer), (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # one left-padded row
    return ids, mask


def adamw(model) -> tuple[torch.optim.Optimizer, None]:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-5), None


def train(strategy, model, ids, mask) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float]]:
    model, optimizer, _ = strategy.prepare(model, adamw)
    norms = [one_step(strategy, model, optimizer, ids, mask) for _ in range(STEPS)]
    return model, optimizer, norms


def one_step(strategy, model, optimizer, ids, mask) -> float:
    for k, (a, b) in enumerate(((0, 2), (2, 3))):  # two micro-batches per optimiser step
        with strategy.no_sync(model, last=k == 1):
            response_ids, response_mask = ids[a:b, -RESPONSE:], mask[a:b, -RESPONSE:].bool()
            logprobs, _, values = model(ids[a:b], mask[a:b], response_ids, response_mask, 1.0)
            loss = (logprobs.mean() + values.pow(2).mean()) / 2
            loss.backward()
    norm = strategy.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def full_weights(strategy, model) -> dict[str, torch.Tensor]:
    with strategy.consolidated(model) as plain:
        return {k: v.detach().clone() for k, v in plain.state_dict().items()} if plain is not None else {}


def max_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def sample(policy, ids, mask, seed: int) -> list[list[int]]:
    torch.manual_seed(seed)
    return HFSampler(policy, 6, 1.0, None, 0, 64).sample(ids[:, :5], mask[:, :5]).response_ids.tolist()


class AllGatherCounter:
    """Counts the all-gathers FSDP issues (torch.distributed.all_gather_single, all_gather_into_tensor
    in older torch)."""

    NAMES = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]

    def __init__(self):
        self.count = 0
        self._originals = {n: getattr(dist, n) for n in self.NAMES}

    def __enter__(self):
        for name, original in self._originals.items():
            setattr(dist, name, self._counting(original))
        return self

    def _counting(self, original):
        def counting(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        return counting

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


HEAD_ROUTES = {"packed": dict(padding_free=True), "light": dict(chunk_size=2), "packed_light": dict(padding_free=True, chunk_size=2),
               "shared": dict(padding_free=SharedPrefix(2)), "shared_light": dict(padding_free=SharedPrefix(2), chunk_size=2)}


def head_routes(strategy, tokenizer, rank: int, world: int, tied: bool) -> dict:
    """The packed (ppo.padding_free), shared-prompt (ppo.shared_prompt, groups of 2 rows: a 4-D mask) and memory-light
    (lm_head_chunk_size) logprob routes on a sharded policy, its head
    tied to its embeddings (both in FSDP's root unit, gathered only in the model's forward) or not (the backbone and the
    head units of their own): each process's logprobs and entropy, and the gradients of a loss of them after FSDP's
    reduce-scatter (gathered whole), beside the whole policy's padded computation over every process's rows; a frozen
    (shard_frozen) copy's logprobs under inference mode too. -> tensors (got, want) per route."""
    torch.manual_seed(0)
    config = tiny_config("llama", tokenizer, hidden=32, layers=2, heads=4)
    config.tie_word_embeddings = tied
    policy = AutoModelForCausalLM.from_config(config)
    assert (policy.get_output_embeddings().weight is policy.get_input_embeddings().weight) == tied
    whole, frozen = copy.deepcopy(policy), strategy.shard(copy.deepcopy(policy), frozen=True)
    sharded = strategy.shard(policy)

    def inputs(r):
        ids, mask = rows(tokenizer, r)
        ids = ids.clone()
        ids[1, :2] = ids[0, 2:4]  # rows 0 (left-padded by 2) and 1 begin with the same 2 tokens: a group's prompt
        trained = mask[:, -RESPONSE:].bool().clone()
        trained[1, -2] = False  # a gap in one row's trained tokens
        weights = torch.randn(trained.shape, generator=torch.Generator().manual_seed(200 + r))
        return ids, mask.bool(), ids[:, -RESPONSE:], trained, weights

    def loss(model, ids, mask, response_ids, trained, weights, **route):
        logprobs, entropy = response_logprobs(model, ids, mask, response_ids, trained, 0.7, with_entropy=True, entropy_grad=True, **route)
        return ((logprobs + 0.1 * entropy) * weights).sum(), logprobs

    # FSDP averages the gradients over processes: the whole policy's are those of the mean of every process's loss
    want_logprobs = None
    for r in range(world):
        value, logprobs = loss(whole, *inputs(r))
        (value / world).backward()
        want_logprobs = logprobs.detach() if r == rank else want_logprobs
    want_grads = {name: p.grad for name, p in whole.named_parameters()}
    out: dict = {"tokens": sum(int(rows(tokenizer, r)[1].sum()) for r in range(world)), "hidden": 32, "vocab": whole.config.vocab_size}
    for name, route in HEAD_ROUTES.items():
        sharded.zero_grad(set_to_none=True)
        value, logprobs = loss(sharded, *inputs(rank), **route)
        value.backward()
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
        out[name] = {"logprobs": (logprobs.detach(), want_logprobs), "grads": {n: (grads[n], want_grads[n]) for n in want_grads}}
    with torch.inference_mode():
        out["frozen_packed"] = {"logprobs": (loss(frozen, *inputs(rank), padding_free=True)[1], want_logprobs)}
    out["resharded"] = all(p.to_local().numel() < p.numel() or world == 1 for p in [*sharded.parameters(), *frozen.parameters()])
    return out


def main(out: Path, load_from: Path | None) -> None:
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = word_tokenizer([" ".join(WORDS)])
    ids, mask = rows(tokenizer, rank)
    results: dict = {"processes": world}
    ddp = parallel.strategy(ParallelConfig(strategy="ddp"), accelerator)
    fsdp = parallel.strategy(ParallelConfig(strategy="fsdp"), accelerator)
    lazy = parallel.strategy(ParallelConfig(strategy="fsdp", unshard_for_generation=False), accelerator)

    # 1. forward, backward, clipping and AdamW: FSDP equals DDP. Rows differ per process, so the
    #    gradients are only right if both average them over processes the same way.
    ddp_model, _, ddp_norms = train(ddp, build(tokenizer), ids, mask)
    fsdp_model, fsdp_optimizer, fsdp_norms = train(fsdp, build(tokenizer), ids, mask)
    offload = parallel.strategy(ParallelConfig(strategy="fsdp", cpu_offload=True), accelerator)
    offload_model, _, offload_norms = train(offload, build(tokenizer), ids, mask)  # on CPU the shards just stay put
    ddp_weights, fsdp_weights = full_weights(ddp, ddp_model), full_weights(fsdp, fsdp_model)
    offload_weights = full_weights(offload, offload_model)
    initial = build(tokenizer).state_dict()
    if accelerator.is_main_process:
        results["step"] = {
            "ddp_grad_norms": ddp_norms, "fsdp_grad_norms": fsdp_norms, "offload_grad_norms": offload_norms,
            "max_weight_difference": max_difference(ddp_weights, fsdp_weights),
            "offload_max_weight_difference": max_difference(ddp_weights, offload_weights),
            "max_weight_change": max_difference(ddp_weights, initial),
        }
    local = [p for p in fsdp_model.parameters() if p.requires_grad]
    results.setdefault("shards", {})[rank] = {
        "local_elements": sum(p.to_local().numel() for p in local),
        "full_elements": sum(p.numel() for p in local),
        "optimizer_elements": sum(v.to_local().numel() for s in fsdp_optimizer.state.values() for v in s.values() if v.dim()),
    }

    # 2. generation under sharding: the same tokens as the whole policy; one all-gather per unit per
    #    rollout with unshard_for_generation, one per unit per decoded token without.
    whole = ddp.accelerator.unwrap_model(ddp_model).policy
    lazy_model, lazy_optimizer, _ = lazy.prepare(build(tokenizer), adamw)
    expected = sample(whole, ids, mask, seed=7)  # ddp_model trained: compare the fsdp twin of each
    with AllGatherCounter() as once, fsdp.generation(fsdp_model.policy):
        sharded_tokens = sample(fsdp_model.policy, ids, mask, seed=7)
    fresh_whole = build(tokenizer).policy
    with AllGatherCounter() as per_token, lazy.generation(lazy_model.policy):
        lazy_tokens = sample(lazy_model.policy, ids, mask, seed=7)
    results.setdefault("generation", {})[rank] = {
        "same_tokens_as_whole": sharded_tokens == expected,
        "lazy_same_tokens_as_whole": lazy_tokens == sample(fresh_whole, ids, mask, seed=7),
        "all_gathers_unshard_once": once.count, "all_gathers_per_layer": per_token.count,
        "units": len(fsdp._fsdp_modules(fsdp_model.policy)),
    }
    # 2b. requests (what a per-episode loop drives) inside one generation context: each process steps its own
    #     requests as often as they need, another number of steps on each process; no all-gather while stepping
    #     (one there would wait for the other process forever), and the whole policy's tokens.
    mine = [Request(f"{rank}-{i}", ids[i % 3, 2:].tolist(), Sampling(3 + 4 * rank + i, 1.0, None), seed=i) for i in range(1 + 3 * rank)]
    engine = lambda policy: HFEngine(policy, 0, torch.device("cpu"), rows_per_forward=2, max_sequence=32)  # noqa: E731
    with fsdp.generation(fsdp_model.policy), AllGatherCounter() as stepping:
        sharded_requests = complete(engine(fsdp_model.policy), mine)
    results["generation"][rank].update(
        requests_same_tokens_as_whole=[c.token_ids for c in sharded_requests] == [c.token_ids for c in complete(engine(whole), mine)],
        requests_all_gathers=stepping.count, requests_tokens=sum(len(c.token_ids) for c in sharded_requests))
    # after sampling (the first thing a fresh model does in a run, under inference mode) training runs,
    # and the policy is sharded again
    one_step(fsdp, fsdp_model, fsdp_optimizer, ids, mask)
    one_step(lazy, lazy_model, lazy_optimizer, ids, mask)
    results["generation"][rank]["resharded"] = all(
        p.to_local().numel() < p.numel() or world == 1 for p in fsdp_model.policy.parameters())

    # 3. DCP round trip: save, train on, load, and the weights and the next step are the saved run's.
    dcp_dir, weights = out / "dcp", fsdp.checkpoint_weights()
    parts = SimpleNamespace(model=fsdp_model, optimizer=fsdp_optimizer)
    weights.save(dcp_dir, parts, save_models=None, is_main=accelerator.is_main_process)
    at_save = full_weights(fsdp, fsdp_model)
    if accelerator.is_main_process:
        torch.save(at_save, out / "at_save.pt")
    next_norm = one_step(fsdp, fsdp_model, fsdp_optimizer, ids, mask)
    after_next = full_weights(fsdp, fsdp_model)
    weights.load(dcp_dir, parts)
    reloaded = full_weights(fsdp, fsdp_model)
    again_norm = one_step(fsdp, fsdp_model, fsdp_optimizer, ids, mask)
    again = full_weights(fsdp, fsdp_model)
    if accelerator.is_main_process:
        results["dcp"] = {
            "files": sorted(p.name for p in (dcp_dir / parallel.SHARDED_DIR).iterdir()),
            "reloaded_vs_saved": max_difference(reloaded, at_save),
            "next_step_vs_replay": max_difference(after_next, again),
            "next_grad_norm": next_norm, "replayed_grad_norm": again_norm,
            "moved_by_next_step": max_difference(after_next, at_save),
        }

    # 3b. the non-finite guard's rollback (guards.UpdateSnapshot) restores sharded weights and optimiser state
    schedule = torch.optim.lr_scheduler.LambdaLR(fsdp_optimizer, lambda step: 1.0)
    before = full_weights(fsdp, fsdp_model)
    snapshot = UpdateSnapshot(fsdp_model, fsdp_optimizer, schedule)
    one_step(fsdp, fsdp_model, fsdp_optimizer, ids, mask)
    stepped = full_weights(fsdp, fsdp_model)
    snapshot.restore(scheduler_steps=1)
    restored = full_weights(fsdp, fsdp_model)
    if accelerator.is_main_process:
        results["rollback"] = {"moved": max_difference(stepped, before), "restored_vs_before": max_difference(restored, before)}

    # 4. consolidated save: final/-style folders from the sharded model, loadable by transformers alone.
    with fsdp.consolidated(fsdp_model) as plain:
        if plain is not None:
            roles.save_policy(plain.policy, out / "policy")
            roles.save_value_model(plain.value_model, out / "value_model")
            tokenizer.save_pretrained(out / "policy")
            torch.save({k: v.clone() for k, v in plain.state_dict().items()}, out / "consolidated.pt")

    # 5. LoRA under FSDP (with gradient checkpointing): adapters sharded with their frozen base; adapter
    #    and merged saves.
    lora_ddp, _, _ = train(ddp, build(tokenizer, lora=True, checkpointing=True), ids, mask)
    lora_fsdp, _, lora_norms = train(fsdp, build(tokenizer, lora=True, checkpointing=True), ids, mask)
    lora_ddp_weights, lora_fsdp_weights = full_weights(ddp, lora_ddp), full_weights(fsdp, lora_fsdp)
    with fsdp.consolidated(lora_fsdp) as plain:
        if plain is not None:
            roles.save_policy(plain.policy, out / "lora_policy", out / "lora_merged")
            with torch.inference_mode():
                probe_ids, probe_mask = rows(tokenizer, 0)
                torch.save(response_logits(plain.policy, probe_ids, probe_mask, RESPONSE), out / "lora_logits.pt")
    if accelerator.is_main_process:
        results["lora"] = {"max_weight_difference": max_difference(lora_ddp_weights, lora_fsdp_weights),
                           "grad_norms": lora_norms}

    # 6. resharding: a DCP checkpoint written by another process count, read into this one.
    if load_from is not None:
        other = parallel.strategy(ParallelConfig(strategy="fsdp"), accelerator)
        target, target_optimizer, _ = other.prepare(build(tokenizer), adamw)
        other.checkpoint_weights().load(load_from / "dcp", SimpleNamespace(model=target, optimizer=target_optimizer))
        loaded = full_weights(other, target)
        if accelerator.is_main_process:
            results["reshard"] = {"from_processes": json.loads((load_from / "results.json").read_text())["processes"],
                                  "max_difference_to_saved": max_difference(loaded, torch.load(load_from / "at_save.pt"))}

    # 7. the packed and light heads of a sharded causal LM, its head tied to its embeddings or not
    routes = {name: head_routes(fsdp, tokenizer, rank, world, tied) for name, tied in (("tied", True), ("untied", False))}
    if accelerator.is_main_process:
        torch.save(routes, out / "head_routes.pt")

    # 8. the shared critic (value_model: shared) under fsdp
    critic = shared_critic(ddp, fsdp, tokenizer, ids, mask)
    if accelerator.is_main_process:
        results["shared_critic"] = critic

    gathered = [None] * world
    dist.all_gather_object(gathered, results) if world > 1 else gathered.__setitem__(0, results)
    if accelerator.is_main_process:
        merged = copy.deepcopy(gathered[0])
        for part in gathered[1:]:
            for key in ("shards", "generation"):
                merged[key].update(part[key])
        (out / "results.json").write_text(json.dumps(merged, indent=1))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    finally:
        # as the CLI does (`cli._end_process_group`): gloo's threads left to the interpreter's exit abort a finished
        # process now and then ("terminate called without an active exception"), which fails the launch
        if dist.is_initialized():
            dist.destroy_process_group()
