"""The sizes the model math, the planner and the CUDA kernels must agree on (ints only).

Imported by the planner (which holds no tensors), by the PyTorch reference and by the CUDA runner,
whose kernels receive them as compile definitions (`openjev.worker.cuda.traits`).
"""

# GDN layers run their recurrence in chunks of this many tokens counted from a sequence's start.
# Under the `fixed` policy every shared boundary sits on a multiple of it, so each computed chunk
# is one `off` computes too (same tokens, same chunk split, hence the same rounding).
GDN_CHUNK_TOKENS = 64

# `--gdn-kernel split`: the first position the chunked GDN kernel takes by default (a multiple of
# GDN_CHUNK_TOKENS; before it the token recurrence, faster and more accurate on short prompts;
# 128 measured best of 128, 256 and 512: docs/cuda-kernels.md).
DEFAULT_GDN_SPLIT_AT = 128

# Linear-attention (Gated DeltaNet) key and value head dim the CUDA kernels are written for.
GDN_HEAD_DIM = 128

# Full-attention head dim the attention and rotary kernels are written for.
ATTN_HEAD_DIM = 256

# Depthwise causal conv1d kernel size of the GDN layers (a segment carries CONV_KERNEL_SIZE - 1 inputs).
CONV_KERNEL_SIZE = 4

# qk_norm_rope (cuda/fused_ops.cu) gives each lane 8 of a head's dims and pairs rotary partners
# rotary_dim/16 lanes apart: the rotary dim (head_dim * partial_rotary_factor) is a multiple of it.
ROTARY_DIM_MULTIPLE = 16

# The norm and SiLU-gate kernels move rows in 8-element (16-byte) vectors, and add_rms_norm keeps
# at most 4 vectors a thread of its 256 (fused_ops.cu's RMS_MAXV): hidden_size and
# intermediate_size are multiples of VECTOR_ELEMENTS, hidden_size at most MAX_NORM_WIDTH.
VECTOR_ELEMENTS = 8
MAX_NORM_WIDTH = 8192
