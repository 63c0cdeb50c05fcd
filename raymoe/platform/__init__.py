"""Platforms: what a rank asks of the machine it runs on (``interface``), its implementations (``reference``,
``cpu``, ``cuda``), and the one place that picks among them (``selector``)."""
