"""What k3tui would run here, and what it would take elsewhere: the machine plan, the
fleet capacity model and the deployment recipes. Pure functions over probe facts."""
