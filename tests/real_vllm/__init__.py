"""Suites that need a real vLLM CPU install (run with `pytest -m vllm`), and the shared
server helper `vllm_server` that scripts and later suites reuse."""
