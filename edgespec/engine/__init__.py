"""The engine: config.py (EngineConfig), choices.py and assembly.py (the plan), tuning.py (with
measured.py, its values, and step_costs.py, c(B)), exact_mode.py, opening.py and opened.py (the
plan executed, and what runs), engine.py (Engine, load), response.py and session.py (ChatSession).
The public names are re-exported by `edgespec` itself; import them from there."""
