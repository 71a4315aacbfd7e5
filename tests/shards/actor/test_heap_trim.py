"""Keras's private ``saving_lib.is_memory_sufficient``, which ``weights_read_in_place`` answers
with False, checked against the installed Keras: pyproject bounds it below its next minor
release, and this is what says, naming the hook, that a newer one removed it (the code then
loads as before, with a second copy of the weights, without a word). Likewise TensorFlow's
switch to the system allocator, which every ``import_tensorflow`` turns on (issue 27; what it
saves is measured through the server in tests/e2e/test_memory_back.py)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from shards.actor import tflog
from shards.actor.heap_trim import SYSTEM_ALLOCATOR_ENV, weights_read_in_place


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


def test_import_tensorflow_turns_the_system_allocator_on_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SYSTEM_ALLOCATOR_ENV, raising=False)
    tflog.import_tensorflow()
    assert os.environ[SYSTEM_ALLOCATOR_ENV] == "1"
    monkeypatch.setenv(SYSTEM_ALLOCATOR_ENV, "0")
    tflog.import_tensorflow()
    assert os.environ[SYSTEM_ALLOCATOR_ENV] == "0"


def test_tensorflow_still_reads_the_system_allocator_switch() -> None:
    import tensorflow as tf

    library = Path(tf.__file__).parent / "libtensorflow_framework.so.2"
    assert SYSTEM_ALLOCATOR_ENV.encode() in library.read_bytes(), (
        f"TensorFlow {tf.__version__} no longer reads {SYSTEM_ALLOCATOR_ENV}: with oneDNN on, "
        "its CPU pool keeps freed buffers and a stage holds ~1.9x its weights again; find its "
        "new switch and change shards/actor/heap_trim.py"
    )
