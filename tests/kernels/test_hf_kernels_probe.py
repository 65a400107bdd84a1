"""transformers probes for a package named ``kernels`` (HF hub kernels); ours lives at ``loraserve.kernels``
and must never be mistaken for it, nor installed under that name."""

from __future__ import annotations

from importlib import metadata


def test_transformers_does_not_take_our_kernels_for_hub_kernels() -> None:
    from transformers.utils import import_utils

    assert import_utils.is_kernels_available() is False
    # no installed distribution provides a top-level `kernels`: ours is loraserve.kernels
    providers = metadata.packages_distributions().get("kernels", [])
    assert "loraserve" not in providers
    from loraserve import kernels

    assert kernels.__name__ == "loraserve.kernels"
    assert hasattr(kernels, "add_lora_slices")
