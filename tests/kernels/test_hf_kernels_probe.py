"""transformers probes for a package named ``kernels`` (HF hub kernels); ours must never be mistaken for it."""

from __future__ import annotations


def test_transformers_does_not_take_our_kernels_for_hub_kernels() -> None:
    from transformers.utils import import_utils

    assert import_utils.is_kernels_available() is False
    import kernels

    assert hasattr(kernels, "add_lora_slices")  # and ours is the one that imports
