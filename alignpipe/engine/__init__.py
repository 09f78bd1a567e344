"""Generation engines: one interface (`GenerationEngine`), a transformers backend and a vLLM backend."""
