"""The run folder and what a run saves in it: the folder's rules (run_dir), checkpoints and their files, the training state, model cards.
When a run saves is `training/saving.py`'s."""
