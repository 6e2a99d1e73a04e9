"""The admin console under ``/admin/ui``: a page over the admin REST API, with sessions."""
