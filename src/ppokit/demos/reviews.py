"""The embedded demos: from nothing to a trained policy on a laptop, nothing from a hub.

`ppokit demo` (`run_demo`): a policy that writes positive movie reviews.
1. generate short movie-review data (half positive, half negative) from a small grammar;
2. train a word-level tokenizer on it and build a tiny Llama-style model from a config;
3. fine-tune it (SFT) so it writes reviews in that style, ending with EOS;
4. run PPO with the VADER sentiment analyser as the reward (its compound score);
5. print completions for the same prompts before and after PPO.

The other demos, `ppokit demo --environment NAME` (`ENVIRONMENTS`): `guess`, a guessing game
(ppokit.demos.guess), `calculator`, arithmetic with a calculator tool (ppokit.demos.calculator), and `reasoning-gym`,
a task of reasoning-gym's scored by its own `score_answer` (ppokit.demos.count_bits).

Every demo has its own default folder (`DemoChoice.default_output`), checked before any heavy import
(`demo_folder`: this module imports neither torch nor transformers at its top), and one stopped by
Ctrl-C continues with the same command and `--resume` (`DemoChoice.command`).

`engine` (`rollout.engine`, default hf) samples the PPO episodes; with an engine that declares the head size it serves
(vllm: 64; its CPU attention serves none under 32) the demo model has that head_dim instead of 16 (`model_heads`).
"""

from __future__ import annotations

import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ppokit import engines

from ppokit.run import run_dir
from ppokit.errors import UserError
from ppokit.training.estimators import ESTIMATORS

OPENERS = [
    "the movie was", "this film is", "i thought the plot was", "the acting was", "overall the story felt",
    "the ending was", "honestly the cast was", "the soundtrack is", "the director made it", "my friends found it",
    "the second half was", "the dialogue felt", "the characters were", "as a sequel it is", "the visuals were",
    "for a comedy it was", "the script is", "the pacing was", "this thriller was", "the lead actor was",
]
POSITIVE = ["great", "wonderful", "brilliant", "beautiful", "amazing", "funny", "charming", "excellent",
            "fantastic", "delightful", "lovely", "fun", "good", "perfect", "sweet", "clever"]
NEGATIVE = ["boring", "awful", "terrible", "dull", "bad", "horrible", "weak", "stupid", "painful",
            "ugly", "sad", "disappointing", "poor", "annoying", "messy", "lame"]
NOUNS = ["music", "story", "ending", "cast", "plot", "camera work", "humor", "script", "villain", "score"]
ADVERBS = ["really", "very", "so", "quite", "truly", "pretty"]


def _review(rng: random.Random, words: list[str]) -> str:
    a, b = rng.sample(words, 2)
    noun = rng.choice(NOUNS)
    shape = rng.randrange(3)
    if shape == 0:
        return f"{rng.choice(ADVERBS)} {a} and {b} ."
    if shape == 1:
        return f"{a} , and the {noun} was {b} ."
    return f"{rng.choice(ADVERBS)} {a} . the {noun} was {b} too ."


def make_data(seed: int, n_sft: int, n_prompts: int, n_eval: int) -> dict[str, list[dict]]:
    """SFT pairs (balanced sentiment), PPO training prompts and eval prompts."""
    rng = random.Random(seed)
    sft = []
    for i in range(n_sft):
        words = POSITIVE if i % 2 == 0 else NEGATIVE
        sft.append({"prompt": rng.choice(OPENERS), "completion": _review(rng, words)})
    prompts = [{"prompt": rng.choice(OPENERS)} for _ in range(n_prompts)]
    eval_prompts = [{"prompt": OPENERS[i % len(OPENERS)]} for i in range(n_eval)]
    return {"sft": sft, "prompts": prompts, "eval_prompts": eval_prompts}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


SETTINGS = {
    # quick: under a minute on 2 cores; full: a few minutes, a larger model and a longer run.
    True: dict(hidden=64, layers=2, n_sft=2000, sft_epochs=2, n_prompts=1024, total_episodes=1024, batch=32, lr=3e-4),
    False: dict(hidden=128, layers=4, n_sft=6000, sft_epochs=3, n_prompts=4096, total_episodes=4096, batch=64, lr=1e-4),
}


def model_heads(hidden: int, engine: str) -> int:
    """Attention heads of a demo model of width `hidden` sampled by `engine`: 4 for an engine that serves any head
    size (hf: the demo as documented, head_dim 16 in the quick demo); else as many as give the head size the
    engine declares it serves everywhere (`engines.Engine.head_dim`: vllm's 64)."""
    head_dim = engines.ENGINES[engine].head_dim
    return 4 if head_dim is None else max(1, hidden // head_dim)


def estimator_settings(name: str) -> dict:
    """The ppo keys of one estimator's demo: it, with its usual samples per prompt (ppokit.training.estimators);
    everything else is the same demo."""
    return {"advantage_estimator": name, "num_samples_per_prompt": ESTIMATORS[name].usual_samples_per_prompt}


DEMO_MARKER_KIND = "demo"
DEMO_FILE = "demo.json"  # in a demo's folder: which demo made it (`DemoChoice`), what --resume checks against
ENVIRONMENTS = {  # --environment NAME -> the module and function of that demo, and its default estimator
    "guess": ("ppokit.demos.guess", "run_game_demo"),
    "calculator": ("ppokit.demos.calculator", "run_calculator_demo"),
    "reasoning-gym": ("ppokit.demos.count_bits", "run_task_demo"),
    "calculator-agent": ("ppokit.demos.calculator", "run_calculator_agent_demo"),  # the same task, an openai agent program
}


@dataclass(frozen=True)
class DemoChoice:
    """Which demo: what `ppokit demo` was given, defaults resolved. It names the demo's default folder and the
    command that runs it again (with --resume), and is recorded in the folder (`DEMO_FILE`)."""

    environment: Optional[str] = None  # None: the movie-review demo; else a key of ENVIRONMENTS
    quick: bool = True
    seed: int = 0
    estimator: str = "gae"
    engine: str = "hf"

    @classmethod
    def of(cls, environment: Optional[str] = None, quick: bool = True, seed: int = 0, estimator: Optional[str] = None,
           engine: str = "hf") -> "DemoChoice":
        """The choice, checked: a known environment, estimator (None: the demo's own, `default_estimator`) and engine."""
        if environment is not None and environment not in ENVIRONMENTS:
            raise UserError(f"demo --environment: expected one of {', '.join(ENVIRONMENTS)}, got {environment!r}")
        estimator = default_estimator(environment) if estimator is None else estimator
        if estimator not in ESTIMATORS:
            raise UserError(f"demo --estimator: expected one of {', '.join(ESTIMATORS)}, got {estimator!r}")
        if engine not in engines.ENGINES:
            raise UserError(f"demo --engine: expected one of {', '.join(engines.ENGINES)}, got {engine!r}")
        return cls(environment, bool(quick), int(seed), estimator, engine)

    def flags(self) -> list[str]:
        """The command-line flags that make this demo (the defaults left out)."""
        flags = ["--quick"] if self.quick else []
        if self.environment is not None:
            flags += ["--environment", self.environment]
        if self.estimator != default_estimator(self.environment):
            flags += ["--estimator", self.estimator]
        if self.engine != "hf":
            flags += ["--engine", self.engine]
        if self.seed != 0:
            flags += ["--seed", str(self.seed)]
        return flags

    def default_output(self) -> str:
        """Each demo its own folder, so that one never refuses to start because another ran first: ppokit-demo for
        the quick movie-review demo, then -ENVIRONMENT, -ENGINE (not hf), -ESTIMATOR (not the demo's default),
        -seedN (not 0), -full (without --quick): `ppokit demo --quick --environment guess` writes ppokit-demo-guess."""
        parts = ["ppokit-demo"] + [self.environment] * (self.environment is not None) + [self.engine] * (self.engine != "hf")
        parts += [self.estimator] * (self.estimator != default_estimator(self.environment)) + [f"seed{self.seed}"] * (self.seed != 0)
        return "-".join(parts + ["full"] * (not self.quick))

    def command(self, output: str | Path, *extra: str) -> str:
        """The shell command that runs this demo into `output` (its --output left out when it is the default)."""
        where = [] if str(output) == self.default_output() else ["--output", str(output)]
        return shlex.join(["ppokit", "demo", *self.flags(), *where, *extra])


def default_estimator(environment: Optional[str]) -> str:
    """The estimator a demo trains with unless --estimator says otherwise."""
    if environment is None:
        return "gae"
    import importlib

    return importlib.import_module(ENVIRONMENTS[environment][0]).DEFAULT_ESTIMATOR


def check_demo_output(out: Path, overwrite: bool, resume: bool = False, choice: Optional[DemoChoice] = None) -> None:
    """Before any work: may the demo write into `out`? Absent, empty or an earlier demo's folder, and no
    earlier run in its ppo/, else only with `overwrite`: a refusal after minutes of SFT, or data/ and
    sft/ written over someone's own files, is what this prevents. With `resume`: `out` holds an unfinished run
    of the same demo (`choice`) to continue."""
    run_dir.check_output_dir(str(out), "demo --output")
    if resume:
        check_resumable(out, overwrite, choice)
        return
    if overwrite or not out.is_dir() or run_dir.is_empty_dir(out):
        return
    if run_dir.marker_kind(out) != DEMO_MARKER_KIND:
        raise UserError(f"demo --output {out}: the folder exists and carries no `ppokit demo` marker (the demo writes data/, sft/ and "
                        "ppo/ into it; a demo folder made before ppokit marked them has none); give another --output, or pass "
                        "--overwrite to write there anyway")
    held = run_dir.holds_run(out / "ppo") if (out / "ppo").is_dir() else None
    if held is not None:
        made = recorded_choice(out)
        resume_hint = (f"continue it with `{made.command(out, '--resume')}`, " if held.startswith("an unfinished") and made is not None
                       else "")
        raise UserError(f"demo --output {out}: {out / 'ppo'} holds {held} from an earlier demo; {resume_hint}give another --output, "
                        "or pass --overwrite to replace it")


def check_resumable(out: Path, overwrite: bool, choice: Optional[DemoChoice]) -> None:
    """`ppokit demo ... --resume`: `out` is the folder of the same demo, with its SFT model and an unfinished run in ppo/."""
    if overwrite:
        raise UserError("demo: --resume continues the demo in its folder and --overwrite starts it over: give one of them")
    if not out.is_dir() or run_dir.marker_kind(out) != DEMO_MARKER_KIND:
        raise UserError(f"demo --resume: {out} holds no demo to continue; start one without --resume")
    made = recorded_choice(out)
    if made is None:
        raise UserError(f"demo --resume: {out} does not say which demo made it (no {DEMO_FILE}: an older ppokit); start it over "
                        "with --overwrite")
    if choice is not None and made != choice:
        raise UserError(f"demo --resume: {out} holds another demo, `{made.command(out)}`; continue it with "
                        f"`{made.command(out, '--resume')}`")
    if not (out / "sft" / "config.json").is_file():
        raise UserError(f"demo --resume: {out / 'sft'} holds no SFT model (the demo stopped before its PPO step); start it over "
                        "with --overwrite")
    held = run_dir.holds_run(out / "ppo") if (out / "ppo").is_dir() else None
    if held is None:
        raise UserError(f"demo --resume: {out / 'ppo'} holds no checkpoint (the demo stopped before its first update ended); "
                        "start it over with --overwrite")
    if not held.startswith("an unfinished"):
        raise UserError(f"demo --resume: {out / 'ppo'} holds {held}: nothing to continue; `ppokit report {out / 'ppo'}` shows it")


def recorded_choice(out: Path) -> Optional[DemoChoice]:
    """The demo that made folder `out` (its `DEMO_FILE`), or None when it does not say."""
    try:
        return DemoChoice(**json.loads((Path(out) / DEMO_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def demo_folder(choice: DemoChoice, output_dir: str | Path | None, overwrite: bool, resume: bool = False) -> Path:
    """The demo's output folder (`output_dir`, default `choice.default_output()`), once the folder is checked
    (`check_demo_output`, no heavy import: `ppokit demo` calls this first) and the engine known to be installed."""
    out = Path(output_dir if output_dir is not None else choice.default_output())
    check_demo_output(out, overwrite, resume, choice)
    engines.check_installed(choice.engine)  # before minutes of SFT (an engine's module may import torch)
    return out


def mark_demo_folder(out: Path, choice: DemoChoice) -> None:
    """out made and marked as this demo's (`run_dir` marker, `DEMO_FILE`)."""
    out.mkdir(parents=True, exist_ok=True)
    run_dir.write_marker(out, DEMO_MARKER_KIND)
    (out / DEMO_FILE).write_text(json.dumps(asdict(choice)) + "\n")


def run(choice: DemoChoice, output_dir: str | Path | None = None, show_progress: bool = True, overwrite: bool = False,
        resume: bool = False) -> dict:
    """Run the demo `choice` (into `output_dir`, default its own folder); returns its summary."""
    import importlib

    if choice.environment is None:
        function = run_demo
    else:
        module, name = ENVIRONMENTS[choice.environment]
        function = getattr(importlib.import_module(module), name)
    return function(output_dir, quick=choice.quick, seed=choice.seed, show_progress=show_progress, estimator=choice.estimator,
                    overwrite=overwrite, engine=choice.engine, resume=resume)


def demo_start(choice: DemoChoice, out: Path, prepared: str | Path | None, resume: bool, show_progress: bool, prepare):
    """Steps 1-3 of a demo in `out` (its folder, checked): marked as `choice`'s, then `prepare(out, say)` makes its data and
    SFT model unless they are `prepared` elsewhere or the demo resumes; the seed set for PPO. -> (the folder holding
    data/ and sft/, say: the demo's progress lines on stderr)."""
    import torch

    say = (lambda *a: print(*a, file=sys.stderr)) if show_progress else (lambda *a: None)
    if not resume:
        mark_demo_folder(out, choice)
    base = Path(prepared) if prepared is not None else out if resume else prepare(out, say)
    torch.manual_seed(choice.seed)
    return base, say


def first_and_last(records: list[dict], **metrics: str) -> tuple[int, dict[str, float]]:
    """(window, {NAME_start, NAME_end: metric `metrics[NAME]`'s mean over the first and last `window` updates}), the
    window a sixth of the updates: one batch's figure is noisy."""
    window = max(1, len(records) // 6)
    mean = lambda key, rs: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    return window, {f"{name}_{end}": mean(key, part) for name, key in metrics.items()
                    for end, part in (("start", records[:window]), ("end", records[-window:]))}


def start_ppo(config, show_progress: bool, overwrite: bool):
    """The demo's PPO trainer for `config`."""
    from ppokit.trainer import PPOTrainer

    return PPOTrainer(config, show_progress=show_progress, overwrite=overwrite)


def resume_ppo(trainer, say) -> None:
    """`--resume`: the trainer continues from the latest checkpoint of the demo's ppo/ (weights, optimiser, random
    states, metrics), so the demo ends as it would have without the stop."""
    path = trainer.resume_from()
    say(f"resumed from {path} (update {trainer.state.update} of {trainer.sizes.num_updates})")


def prepare_demo(out: Path, quick: bool, seed: int, say, engine: str = "hf") -> Path:
    """Steps 1-3: the data, a tokenizer and a tiny model (shaped for `engine`: `model_heads`), fine-tuned by SFT
    into out/sft; returns out."""
    from ppokit.training.sft import encode_pair
    from ppokit.demos.tiny import word_tokenizer

    s = SETTINGS[quick]
    start_demo_folder(out, seed)

    # 1. data
    data = make_data(seed, s["n_sft"], s["n_prompts"], 8)
    for name, rows in data.items():
        write_jsonl(out / "data" / f"{name}.jsonl", rows)
    say(f"[1/4] data: {len(data['sft'])} SFT reviews, {len(data['prompts'])} PPO prompts -> {out / 'data'}")

    # 2. tokenizer and model, 3. SFT
    tokenizer = word_tokenizer([r["prompt"] + " " + r["completion"] for r in data["sft"]])
    examples = lambda: [encode_pair(tokenizer, r["prompt"], r["completion"]) for r in data["sft"]]  # noqa: E731
    sft_tiny_model(out, tokenizer, examples, s, seed, say, heads=model_heads(s["hidden"], engine))
    return out


def start_demo_folder(out: Path, seed: int) -> None:
    """out made (marked by `mark_demo_folder`); the random stream seeded for steps 1-3."""
    import torch

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)


def sft_tiny_model(out: Path, tokenizer, examples, settings: dict, seed: int, say, what: str = "", *, heads: int) -> None:
    """Steps 2-3 of a demo: a tiny Llama of the demo's size with `heads` attention heads for `tokenizer`, fine-tuned
    on `examples()` (built once the model exists, as the random stream expects), saved with the tokenizer in out/sft."""
    from ppokit.models.loading import no_progress_bars
    from ppokit.training.sft import train_sft
    from ppokit.demos.tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", tokenizer, hidden=settings["hidden"], layers=settings["layers"], heads=heads)
    say(f"[2/4] model: tiny Llama, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
        f"(head_dim {settings['hidden'] // heads}), vocabulary {len(tokenizer)}")
    losses = train_sft(model, examples(), tokenizer.pad_token_id, epochs=settings["sft_epochs"], batch_size=32,
                       learning_rate=settings.get("sft_lr", 3e-3), seed=seed)
    sft_dir = out / "sft"
    with no_progress_bars():
        model.save_pretrained(sft_dir)
    tokenizer.save_pretrained(sft_dir)
    say(f"[3/4] SFT{what}: loss {losses[0]:.2f} -> {sum(losses[-20:]) / len(losses[-20:]):.2f} over {len(losses)} steps -> {sft_dir}")


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean of `values` and its standard error (sample standard deviation / sqrt(n); 0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def run_demo(
    output_dir: str | Path | None = None, quick: bool = False, seed: int = 0, show_progress: bool = True,
    estimator: str = "gae", prepared: str | Path | None = None, overwrite: bool = False, engine: str = "hf",
    resume: bool = False,
) -> dict:
    """Run the whole demo; returns a summary with the first and last scores and the time taken.

    output_dir: default the demo's own folder (`DemoChoice.default_output`: ppokit-demo with quick).
    estimator: one of ppokit.training.estimators.ESTIMATORS (ppo.advantage_estimator and its usual number of samples per
    prompt). engine: `rollout.engine` (one of ppokit.engines.ENGINES; the model's shape follows it, `model_heads`).
    prepared: the output folder of an earlier demo with the same `quick`, `seed` and `engine`,
    whose data/ and sft/ are used instead of building them again. overwrite: write into a folder that is
    not an earlier demo's, or replace the run in its ppo/ (`check_demo_output`). resume: continue the demo's
    stopped run in output_dir (`check_resumable`). The multi-turn demos are `ENVIRONMENTS`.
    """
    choice = DemoChoice.of(None, quick, seed, estimator, engine)
    out = demo_folder(choice, output_dir, overwrite, resume)
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig

    start = time.perf_counter()
    s = SETTINGS[quick]
    base, say = demo_start(choice, out, prepared, resume, show_progress, lambda out, say: prepare_demo(out, quick, seed, say, engine))

    # 4. PPO against VADER sentiment
    config = PPOConfig(
        model=str(base / "sft"),
        output_dir=str(out / "ppo"),
        seed=seed,
        reward=RewardConfig(functions=["sentiment"]),
        data=DataConfig(train=str(base / "data" / "prompts.jsonl"), eval=str(base / "data" / "eval_prompts.jsonl")),
        rollout=RolloutConfig(engine=engine),
        ppo=PPOHyperparams(
            total_episodes=s["total_episodes"],
            per_device_train_batch_size=s["batch"] // 2,
            gradient_accumulation_steps=1,
            num_mini_batches=2,
            num_ppo_epochs=4,
            response_length=16,
            temperature=1.0,
            learning_rate=s["lr"],
            kl_coef=0.05,
            num_sample_generations=4,
            num_eval_samples=8,
            **estimator_settings(estimator),
        ),
    )
    trainer = start_ppo(config, show_progress, overwrite)
    n = trainer.sizes.samples_per_prompt
    samples = f" ({trainer.sizes.prompts_per_update} prompts x {n} samples)" if n > 1 else ""
    say(f"[4/4] PPO ({estimator}, rollout.engine {engine}): {trainer.sizes.num_updates} updates of {trainer.sizes.batch} episodes{samples}, reward = VADER "
        "compound sentiment")
    before = trainer.sample_completions()  # the policy before PPO: also the run's samples of update 0 (samples.jsonl, the report)
    if resume:
        resume_ppo(trainer, say)
    records = trainer.train()
    try:
        after = trainer.sample_completions()
    finally:  # train() closed the engine and these samples built it again: its memory freed now, not at exit
        trainer.rollout_engine.close()
    elapsed = time.perf_counter() - start

    say("\ncompletions before -> after PPO (score):")
    for b, a in zip(before, after):
        say(f"  {b['prompt']!r}\n    before {b['score']:+.2f}  {b['completion']}\n    after  {a['score']:+.2f}  {a['completion']}")
    window = max(1, min(3, len(records) // 4))
    mean_score = lambda rs: sum(r["objective/scores"] for r in rs) / len(rs)  # noqa: E731
    eval_after, error = mean_and_error([r["score"] for r in after])
    last_eval = next((r["eval/scores"] for r in reversed(records) if "eval/scores" in r), None)
    summary = {
        "score_start": mean_score(records[:window]),  # mean over the first updates: one batch is noisy
        "score_end": mean_score(records[-window:]),
        "eval_before": sum(r["score"] for r in before) / len(before),
        "eval_after": eval_after,
        "eval_after_error": error,  # the standard error of eval_after: one completion per prompt, a few prompts
        "eval_last_update": last_eval,  # the eval score of the last update's line: another draw with the same weights
        "estimator": estimator,
        "engine": engine,
        "kl_start": records[0]["objective/kl"],
        "last_kl": records[-1]["objective/kl"],
        "updates": len(records),
        "seconds": round(elapsed, 1),
        "output_dir": str(out),
    }
    say(f"\nscore {summary['score_start']:+.3f} -> {summary['score_end']:+.3f} (means of the first and last {window} updates), "
        f"KL {summary['last_kl']:.3f}, {elapsed:.0f}s.")
    say(f"eval {summary['eval_before']:+.3f} -> {eval_after:+.3f} ± {error:.3f}: the mean score of one completion for each of the "
        f"{len(after)} eval prompts, before PPO and after it (± its standard error).")
    if last_eval is not None:
        say(f"The last update's line said eval {last_eval:+.3f}: the same prompts and weights, other completions drawn; "
            "a mean of so few completions varies that much from one draw to the next.")
    say(f"Run directory: {out / 'ppo'}")
    return summary
