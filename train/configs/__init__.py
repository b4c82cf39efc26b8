"""The shipped training recipes: `speculators train NAME` runs NAME.yaml from this folder."""
