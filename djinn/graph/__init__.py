"""The Semantically Rich Graph (SRG): captured ops with meaning and cost attached."""
