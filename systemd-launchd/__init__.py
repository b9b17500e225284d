"""Service definition templates (systemd units, launchd plist), rendered by kvwake.client.service.

A package only so that an installed wheel can carry these files
(pyproject: `"kvwake.service_templates" = "systemd-launchd"`).
"""
