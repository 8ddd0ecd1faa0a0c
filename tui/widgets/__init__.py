"""Widgets of the inspector: slot-time charts (Line API), the envelope bar, navigation bars."""
