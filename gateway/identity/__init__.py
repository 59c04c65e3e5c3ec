"""Identity: admin users and roles, sessions, 2FA, OIDC, LDAP, SAML, SCIM 2.0, OAuth tokens
and the security audit log. `gateway.identity.routes.add_routes(app)` installs all of it (see
docs/identity.md). Nothing is imported here: the command line reads the vault, and importing
every handler (LDAP, SAML, JWT) with it cost each `svc` command most of a second."""
