"""Model kernels: the lean Qwen2/Llama forward, the policy and critic forward passes and the
generation helpers (prompt encoding, EOS ids, the cut after the first EOS).

Both the engine and the backends (:mod:`alignzoo.plugins.backends.hf`, ``vllm``) use them, so
they live below both; this package imports only the package root.
"""
