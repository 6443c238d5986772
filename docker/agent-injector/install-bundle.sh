#!/bin/sh
# The agent-injector's only job: copy the agent bundle into a volume shared with the
# sandbox's container, which then starts /orchard/bin/orchard-agent (see README.md).
#
#   install-bundle.sh [TARGET]      TARGET: $ORCHARD_BUNDLE_TARGET, else /orchard
#
# POSIX sh with cp, mv, rm, mkdir, cmp and sha256sum: busybox or coreutils. The copy is
# staged inside TARGET (a volume's root cannot be renamed), checked against SHA256SUMS,
# moved into place, and the manifest goes last: its presence marks a complete bundle.
# A restarted pod whose volume already holds this very bundle copies nothing.
set -eu
SOURCE=${ORCHARD_BUNDLE_SOURCE:-/orchard-bundle}
TARGET=${1:-${ORCHARD_BUNDLE_TARGET:-/orchard}}
MANIFEST=orchard-bundle.json

if [ ! -f "$SOURCE/$MANIFEST" ]; then
    echo "install-bundle: no agent bundle at $SOURCE" >&2
    exit 2
fi
if [ -f "$TARGET/$MANIFEST" ] && cmp -s "$SOURCE/$MANIFEST" "$TARGET/$MANIFEST"; then
    echo "install-bundle: $TARGET already holds this bundle"
    exit 0
fi
mkdir -p "$TARGET"
STAGE="$TARGET/.incoming-$$"
rm -rf "$STAGE"
mkdir "$STAGE"
cp -a "$SOURCE/." "$STAGE/"
if ! (cd "$STAGE" && sha256sum -c SHA256SUMS >/dev/null); then
    echo "install-bundle: the copy in $STAGE does not match SHA256SUMS" >&2
    rm -rf "$STAGE"
    exit 1
fi
rm -f "$TARGET/$MANIFEST"
for entry in "$STAGE"/* ; do
    name=${entry##*/}
    [ "$name" = "$MANIFEST" ] && continue
    rm -rf "${TARGET:?}/$name"
    mv "$entry" "$TARGET/$name"
done
mv "$STAGE/$MANIFEST" "$TARGET/$MANIFEST"
rmdir "$STAGE"
echo "install-bundle: agent bundle installed at $TARGET"
