"""Tools around the trainer, each run from the repository root as `python -m tools.<name>` (or through
`python graft.py <command>`): the tiny CPU preset (tiny), the mechanism panel for any pair (panel), the pair
rehearsal (preflight), complementarity of candidate models (complement), curves (plot), GRAFT inside TRL
(graft_trl)."""
