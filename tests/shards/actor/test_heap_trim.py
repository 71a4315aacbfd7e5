"""Keras's private ``saving_lib.is_memory_sufficient``, which ``weights_read_in_place`` answers
with False, checked against the installed Keras: pyproject bounds it below its next minor
release, and this is what says, naming the hook, that a newer one removed it (the code then
loads as before, with a second copy of the weights, without a word)."""

from __future__ import annotations

import inspect

from shards.actor.heap_trim import weights_read_in_place


def test_keras_loads_weights_through_is_memory_sufficient() -> None:
    from keras.src.saving import saving_lib

    hook = getattr(saving_lib, "is_memory_sufficient", None)
    assert callable(hook), (
        "keras.src.saving.saving_lib.is_memory_sufficient is gone, so stages load with a second "
        "in-memory copy of their weights; pin keras in pyproject.toml or port shards/actor/heap_trim.py"
    )
    loader = inspect.getsource(saving_lib)
    assert "if is_memory_sufficient(model):" in loader, (
        "keras's saving_lib no longer asks is_memory_sufficient(model) while loading; "
        "shards/actor/heap_trim.py's weights_read_in_place no longer changes how weights are read"
    )
    with weights_read_in_place():
        assert saving_lib.is_memory_sufficient(None) is False
    assert saving_lib.is_memory_sufficient is hook
