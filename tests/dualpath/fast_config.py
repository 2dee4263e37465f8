"""Engine sizes that keep the in-process DualPath tests fast (small blocks, uncapped storage NICs)."""

FAST = dict(
    block_tokens=16,
    max_tokens=256,
    pe_snic_bytes_per_s=1e9,
    de_snic_bytes_per_s=1e9,
    timeout_s=10.0,
    pe_buffer_bytes=1 << 20,
    de_buffer_bytes=2 << 20,
)
