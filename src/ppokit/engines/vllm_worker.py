"""Runs inside vLLM's worker (`LLM(worker_extension_cls="ppokit.engines.vllm_worker.WeightSync")`):
the method `VLLMEngine.sync_weights` calls there with `llm.collective_rpc`.

Why not `model.load_weights(...)` (the path TRL and OpenRLHF use on GPU): on vLLM's CPU backend each
linear weight is copied into a oneDNN handle at load time and the parameter emptied, so a plain
load_weights fails ('Parameter' object has no attribute 'weight_loader'). vLLM's in-place reload
(`reload_weights`) restores the layers, loads and re-runs each layer's post-load processing. It must
receive every tensor in one call: one call per parameter leaves the fused layers (qkv, gate/up)
with only the last part loaded. Layers that keep a weight beside their packed copy (the vocabulary
embedding, and an lm_head tied to it) are re-processed after: a tied lm_head receives no tensor of
its own, so the reload leaves it multiplying by the old packed copy.
"""

from __future__ import annotations


class WeightSync:
    """Mixed into vLLM's worker class (it provides `reload_weights` and `model_runner`)."""

    def ppokit_load_weights(self, weights) -> int:
        """Load (name, tensor) pairs (checkpoint names, an iterable consumed once) in place; returns how
        many tensors were read."""
        counted = _Counted(weights)
        self.reload_weights(weights_iterator=counted)
        reprocess_kept_weights(self.model_runner.get_model())
        return counted.n


class _Counted:
    def __init__(self, pairs):
        self.pairs, self.n = pairs, 0

    def __iter__(self):
        for pair in self.pairs:
            self.n += 1
            yield pair


def reprocess_kept_weights(model) -> None:
    """Re-run the post-load step of every unquantized vocabulary layer (embed_tokens, lm_head): on
    CPU it re-packs the GEMM from the weight the layer keeps (shared with embed_tokens when tied)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # on GPU the layers multiply by the weight itself
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
