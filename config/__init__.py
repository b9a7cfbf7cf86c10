"""Typed settings for ctxproxy: ``load_settings`` builds the one frozen ``Settings`` object at start."""

from ctxproxy.config.parsers import Secret
from ctxproxy.config.settings import SERVER_KEYS, ModelProfile, Settings, SettingsError, load_settings, setting_help

__all__ = ["SERVER_KEYS", "ModelProfile", "Secret", "Settings", "SettingsError", "load_settings", "setting_help"]
