"""Large blocks keep mappings of their own after a larger one was freed (``proxy.engine.state.map_large_blocks``):
glibc's moving threshold otherwise serves them from the heap, where what outlives a request pins their pages."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROBE = textwrap.dedent("""
    import ctypes, sys
    from ctxproxy.proxy.engine.state import map_large_blocks
    if sys.argv[1] == "held":
        map_large_blocks()
    big = bytearray(8 << 20)  # mapped, then freed: glibc raises its threshold to 8 MB unless it was set
    del big
    block = bytearray(1 << 20)
    address = ctypes.addressof((ctypes.c_char * len(block)).from_buffer(block))
    for line in open("/proc/self/maps"):
        span, name = line.split()[0], line.split()[-1]
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            print("heap" if name == "[heap]" else "own")
""")


def _where(mode: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this checkout's ctxproxy
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                          env=env).stdout


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_a_large_block_after_a_larger_one_was_freed_is_mapped_on_its_own() -> None:
    assert _where("default").startswith("heap")  # the moving threshold, as glibc leaves it
    assert _where("held").startswith("own")
