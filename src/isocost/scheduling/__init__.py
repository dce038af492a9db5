"""Pure: the scheduling framework (filters -> weighted scorers -> picker), policies, admission."""
