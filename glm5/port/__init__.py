"""The porting kit (docs/porting.md): `glm5 port init` writes an out-of-tree backend package that declines
every op with "not ported yet"; `glm5 port status` reports how far a backend is from running GLM-5."""
