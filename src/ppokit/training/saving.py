"""What a run writes and reads back, and its bookkeeping: the run folder (locked from the first write or resume until
the run ends), a checkpoint at most once per update, final/, the models as loadable folders, and a resume from a
checkpoint. `ppokit.run.checkpoint` writes and reads a checkpoint; this module knows which update was saved where, and so
which checkpoint a stop names."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Optional

from ppokit.run import checkpoint, model_card, run_dir
from ppokit.run.checkpoint import RunFacts, TrainedParts
from ppokit.models.loading import no_progress_bars
from ppokit.training.parts import Parts
from ppokit.models.roles import write_models
from ppokit.run.state import TrainingState


class Saving:
    """The saving of one run into `output_dir` (its folder, which update was saved where); each call that writes or reads
    the run's parts (the models, optimiser, data, sizes: `parts.Parts`) is given them. overwrite: a fresh run may replace
    the run there (kept until this one's first checkpoint) or write into a folder that ppokit did not make (`ppokit.run.run_dir`)."""

    def __init__(self, output_dir: str | Path, overwrite: bool = False):
        # Absolute, once, before any user code runs: an environment or reward function that changes the working
        # directory must not split the run between two folders. (The config is validated after this: `parts.assemble`.)
        self.output_dir, self.overwrite = Path(output_dir).absolute(), overwrite
        self.run: Optional[run_dir.RunFolder] = None
        self.saved_at: Optional[tuple[int, Path]] = None  # (update, path) of the last checkpoint written or resumed from

    @property
    def last_checkpoint(self) -> Optional[Path]:
        return self.saved_at[1] if self.saved_at else None

    def folder(self, parts: Parts) -> run_dir.RunFolder:
        """output_dir, locked for this run (until `close`), its leftovers cleared (`ppokit.run.run_dir`)."""
        if self.run is None:
            self.run = run_dir.RunFolder.open(self.output_dir, parts.accelerator.is_main_process, self.overwrite)
            weakref.finalize(self, self.run.close)
            for note in self.run.notes:
                parts.say(note)
        return self.run

    def close(self) -> None:
        """The lock; a replacing run that reached no checkpoint leaves the earlier one as it was."""
        if self.run is not None:
            self.run.close()
            self.run = None

    def files(self) -> Path:
        """Where this run writes now (`RunFolder.start`)."""
        return self.run.files if self.run is not None else self.output_dir

    def checkpoint(self, parts: Parts, state: TrainingState) -> Path:
        """The whole training state in output_dir/checkpoints/update-N/ (see ppokit.run.checkpoint), once per update."""
        if self.saved_at is None or self.saved_at[0] != state.update:
            run = self.folder(parts)

            def written(path: Path) -> None:
                replacing = run.staged
                self.saved_at = (state.update, run.commit(path))  # a run replacing another takes its place now
                if replacing:
                    parts.say(f"{run.root}: the earlier run there is replaced by this one, whose first checkpoint is written")

            checkpoint.save_checkpoint(state, trained_parts(parts), parts.config, self.run_facts(parts),
                                       lambda folder: self.models(parts, folder, merged=False, kind="model"), parts.accelerator,
                                       written)
        return self.saved_at[1]

    def final(self, parts: Parts, state: TrainingState) -> Path:
        """policy + tokenizer + model card in final/, the value model (with the tokenizer, if there is one) in final/value_model/, whole."""
        target = self.folder(parts).commit() / "final"
        card = model_card.ppo_card(parts.config, state.records[-1] if state.records else None, parts.sizes.num_updates)
        try:
            self.models(parts, target, replace_unmarked=self.overwrite, card=card)
        except run_dir.NoSpaceError as e:
            raise run_dir.full_disk(e, target, self.last_checkpoint) from None
        parts.accelerator.wait_for_everyone()
        return target

    def models(self, parts: Parts, target: Path, merged: bool = True, kind: str = "final", replace_unmarked: bool = False,
               card: Optional[model_card.ModelCard] = None) -> None:
        """Policy, tokenizer and value model as loadable folders (with `card`, their README.md); `merged`: also
        final/merged/ if configured. Every process calls this; the main one writes the strategy's whole copy of the models."""
        with parts.strategy.consolidated(parts.model) as whole, no_progress_bars():
            if whole is not None:
                merged = merged and parts.config.save_merged
                run_dir.atomic_save_dir(target, lambda folder: write_models(folder, whole, parts.tokenizer, merged, card), kind,
                                        replace_unmarked)

    def resume(self, parts: Parts, path: str | Path | None, force: bool = False) -> tuple[TrainingState, Path]:
        """(the TrainingState, the path) of checkpoint `path` (default: the latest complete one in output_dir/checkpoints), every part
        restored from it (`checkpoint.load_checkpoint`; a config that would change the result is refused unless `force`),
        the run's length continued to ppo.total_episodes (`parts.sizes`)."""
        path = checkpoint.find_checkpoint(str(path) if path is not None else None, self.output_dir, parts.say)
        run_dir.check_resume_into(self.output_dir, path)
        self.folder(parts)  # this run's from here on: the lock before anything is restored into it
        state = checkpoint.load_checkpoint(path, trained_parts(parts), parts.config, self.run_facts(parts), parts.accelerator,
                                           force=force, say=parts.say)
        sizes = parts.sizes
        parts.sizes = sizes._replace(num_updates=checkpoint.continued_updates(sizes.total_episodes, sizes.batch, state, path))
        own = checkpoint.checkpoints_dir(self.output_dir) / f"update-{state.update}"
        # The checkpoint to name after a stop; it is re-saved only when it is another folder's.
        self.saved_at = (state.update if own.exists() and own.resolve() == path.resolve() else -1, path)
        return state, path

    def run_facts(self, parts: Parts) -> RunFacts:
        return RunFacts(self.files(), parts.train_data, parts.eval_data, parts.sizes.batch, parts.sizes.num_updates,
                        parts.config.ppo.save_total_limit, parts.sizes.samples_per_prompt)


def trained_parts(parts: Parts) -> TrainedParts:
    """What a checkpoint saves and restores of the run's parts (`checkpoint.TrainedParts`)."""
    return TrainedParts(parts.accelerator.unwrap_model(parts.model), parts.optimizer, parts.scheduler, parts.kl_controller,
                        parts.scorer, parts.layout.policy_adapter or parts.layout.critic_adapter, parts.strategy.checkpoint_weights())
