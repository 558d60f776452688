"""Built-in semantic plugins, registered through the same entry points a third party uses."""
