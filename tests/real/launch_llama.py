"""Runs ``llama_cpp.server`` with llama.cpp's extra buffer types off.

This machine's CPU advertises AMX but the VM faults on it, so the server dies on its first completion unless the
model loads without the extra (AMX) buffer types (a fault seen on the test machines). It runs under the cached
llama-cpp-python venv built by ``scripts/real-model``, not under the project's venv.
"""

import runpy
import sys

import llama_cpp.llama_cpp as lib

_default_params = lib.llama_model_default_params


def _params_without_extra_bufts():
    params = _default_params()
    params.use_extra_bufts = False
    return params


lib.llama_model_default_params = _params_without_extra_bufts
sys.argv = ["llama_cpp.server", *sys.argv[1:]]
runpy.run_module("llama_cpp.server", run_name="__main__")
