"""GLM-5.2 (`glm_moe_dsa`): our trainable PyTorch implementation.

config.py      `Glm5Config` (every config.json field, derived IndexShare / MoE schedules)
layers.py      RMSNorm, interleaved RoPE, SwiGLU, key-validity and masked softmax helpers
indexer.py     DSA lightning indexer: streaming top-k, DSA warm-up KL loss
attention.py   MLA in absorbed form, sparse attention by gathering the selected latents, IndexShare carry
moe.py         fp32 sigmoid router with fp32 correction bias, group-limited top-k, experts, shared expert
decoder.py     decoder layer, KV cache
mtp.py         MTP layer, shared-parameter multi-step training forward (KVShare, IndexShare), CE and TV losses
model.py       backbone, causal LM (policy), value model (critic), replay of indexer top-k / routed experts,
               load_hf (either from an HF folder)
checkpoint.py  HF-format sharded safetensors in and out (GLM-5.2 tensor names), block-FP8 de-quantisation
tiny.py        `glm52-tiny[:seed]`: a tiny random GLM-5.2 with the default policy's tokenizer, for tests
"""

from models.glm5.checkpoint import save_hf
from models.glm5.config import Glm5Config, derive_indexer_types
from models.glm5.decoder import Glm5Cache
from models.glm5.model import Glm5ForCausalLM, Glm5ForValue, Glm5Model, load_hf

__all__ = ["Glm5Config", "derive_indexer_types", "Glm5Cache", "Glm5Model", "Glm5ForCausalLM", "Glm5ForValue",
           "load_hf", "save_hf"]
