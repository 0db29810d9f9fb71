"""The status page the node serves itself: its own metrics history, the
entry-log map with what pins old logs, and the page's static assets (``static/``)."""
