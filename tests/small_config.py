"""A two-layer config (one Gated DeltaNet layer, one attention layer), small enough to count
every weight by hand: the benchmark tests' floors and parameter counts are checked on it."""

from openjev.worker.checkpoint.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig

SMALL = ModelConfig(
    vocab_size=32,
    hidden_size=8,
    intermediate_size=16,
    layer_types=(LINEAR_ATTENTION, FULL_ATTENTION),
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=4,
    linear_value_head_dim=4,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    partial_rotary_factor=0.25,
)
