"""The ``fd-cudagraph`` tools: plan, tune, doctor, demo. Never imported by ``core``."""
