"""Sharding-planner extension for lookahead-cached tables (see DESIGN.md section 3)."""
