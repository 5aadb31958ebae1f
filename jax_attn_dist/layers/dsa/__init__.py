"""dsa_attention: a whole DeepSeek Sparse Attention layer in one call (SPEC
§10): the indexer's top-k selection (``indexer_topk``), sparse MLA attention
over it (``sparse_mla``) and the indexer's KL loss towards the attention's
mass on the same keys (``attn_dist`` + ``indexer_kl``, as ``indexer_loss``)."""

from .api import DsaAttentionOutput, dsa_attention

__all__ = ["DsaAttentionOutput", "dsa_attention"]
