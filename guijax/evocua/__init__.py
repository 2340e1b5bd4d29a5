"""EvoCUA (evocua.txt): dynamic compute budgeting for rejection sampling (§5.2, Eq. 1), step-level
denoising of the successes it keeps (§5.2), and step-level DPO at critical forking points (§5.3, Eq. 2)."""
