"""ctxproxy's one installed name: ``ctxproxy.proxy``, ``ctxproxy.store`` and ``ctxproxy.config``.

The code lives in the repository's top-level folders ``proxy/``, ``store/`` and ``config/``; installed under those
names they would collide with any other package called ``proxy``, ``store`` or ``config`` in the user's
environment. This package holds them as subpackages: in a checkout through the links beside this file, in a wheel
as real folders (setuptools follows the links when it builds).
"""
