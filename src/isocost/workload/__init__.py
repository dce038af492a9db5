"""Pure: arrival processes x length distributions x trace loaders."""
