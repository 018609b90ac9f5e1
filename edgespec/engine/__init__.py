"""The engine: config.py (EngineConfig), choices.py and assembly.py (the plan), tuning.py,
exact_mode.py, engine.py (Engine, load) and session.py (ChatSession). The public names are
re-exported by `edgespec` itself; import them from there."""
