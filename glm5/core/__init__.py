"""The model core: config, layers, attention, MoE, caches and checkpoint I/O.

It imports only `backends` (the public interface) and the infrastructure below both (glm5/infra: files,
locks, progress): `glm5.parallel` and `quant` sit above it, the conformance suite and the applications
(train, deploy, port, generate, export, the vLLM plugin, the CLI) above those (README "Layers").
"""
