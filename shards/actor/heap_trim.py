"""Giving freed host memory back to the system after a stage loads.

Loading reads every weight through buffers of its own (the h5 file's bytes, a numpy array per
variable) before TensorFlow copies it into the variable. Freed, the pieces under glibc's mmap
threshold (32 MiB at most) stay in the heap's arenas, so a stage of many mid-sized layers kept
1.2-1.9x its weights above a bare TensorFlow process (a 1.2 GB MLP of 17 MB layers, issue 12).
``malloc_trim`` returns the free pages; the variables are all that stays.

Where TensorFlow's oneDNN ops are on (by default on a CPU with AVX-512 VNNI, BF16 or AMX), its
CPU allocator keeps every buffer of 256 KiB or more in a BFC pool that never shrinks: the
layers' initial values, freed once the saved weights are in, stayed there (1.9x a stage's
weights above a bare TensorFlow process, out of ``malloc_trim``'s reach; issue 27).
``use_system_allocator`` has those buffers come from malloc, which gives them back when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

# Read by TensorFlow once, at its first CPU allocation: set before the process runs any op.
SYSTEM_ALLOCATOR_ENV = "TF_ONEDNN_USE_SYSTEM_ALLOCATOR"


def use_system_allocator() -> None:
    """TensorFlow's oneDNN CPU allocator hands large buffers to malloc instead of keeping them
    in its pool; a value the user set is kept. Call it before this process's first TensorFlow
    op (importing TensorFlow runs none); later it changes nothing."""
    os.environ.setdefault(SYSTEM_ALLOCATOR_ENV, "1")


def release_free_heap() -> bool:
    """Collect garbage and hand free heap pages back to the OS; False where libc has no
    ``malloc_trim`` (not glibc: musl, macOS), which is harmless."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        log.debug("libc %s has no malloc_trim; freed heap memory stays mapped", name)
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


@contextmanager
def weights_read_in_place() -> Iterator[None]:
    """Within: Keras loads a ``.keras`` file's weights variable by variable from the file.

    When it guesses that memory suffices, ``keras.saving.load_model`` first reads the whole
    ``model.weights.h5`` into one in-memory buffer, a second full copy of the weights at the
    loading peak. Told that memory does not suffice, it extracts the h5 file to a temporary
    directory beside the stage file (or, where it cannot, reads it from the archive) and h5py
    reads one variable at a time. Keras 3's private hook: without it, loading is as before.
    """
    try:
        from keras.src.saving import saving_lib
    except ImportError:
        saving_lib = None
    original = getattr(saving_lib, "is_memory_sufficient", None)
    if original is None:
        yield
        return
    saving_lib.is_memory_sufficient = lambda model: False
    try:
        yield
    finally:
        saving_lib.is_memory_sufficient = original
