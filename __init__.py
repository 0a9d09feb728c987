"""g4rt: a compiled-graph inference engine for Gemma 4 text models."""
