"""Identity: admin users and roles, sessions, 2FA, OIDC, LDAP, SAML, SCIM 2.0, OAuth tokens
and the security audit log. `add_routes(app)` installs all of it (see docs/identity.md)."""

from gateway.identity.routes import add_routes

__all__ = ["add_routes"]
