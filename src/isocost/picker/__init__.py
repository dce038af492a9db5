"""``isocost picker``: the brain as a Gateway API Inference Extension endpoint picker."""
