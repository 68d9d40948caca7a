"""This process among others and on this machine: parallel strategies and the accelerator, the launcher's environment, signals, CPU threads, worker threads for
user code, random states, what a run needs of the machine."""
