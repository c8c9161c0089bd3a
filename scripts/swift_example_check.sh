#!/usr/bin/env bash
# Builds and runs examples/swift-app, an app that depends on pyfa BY VERSION
# (.package(url:from:)), against the current commit: HEAD's files become a
# one-commit repository tagged with pyfa's version (pyproject.toml), set as
# the mirror of pyfa's canonical URL. SwiftPM refuses unsafe build flags in a
# package resolved by version, so this fails if a product's targets have any;
# it also fails unless Package.resolved pins that version, and unless the app
# (which checks its results against a float64 reference) exits 0.
# Only committed files are checked: commit first.
set -euo pipefail
cd "$(dirname "$0")/.."
url=https://github.com/pyfa-project/pyfa.git
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
if [ -z "$version" ]; then
    echo "swift_example_check: no version in pyproject.toml" >&2
    exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

repo="$tmp/pyfa"
mkdir "$repo"
git archive HEAD | tar -x -C "$repo"
git -C "$repo" init -q
git -C "$repo" add -A
git -C "$repo" -c user.name=pyfa-check -c user.email=pyfa-check@localhost commit -q -m "pyfa $version"
git -C "$repo" tag "$version"

app="$tmp/app"
cp -R "$repo/examples/swift-app" "$app"
cd "$app"
swift package config set-mirror --original "$url" --mirror "$repo"
# No shared dependency cache: a cached clone of an earlier mirror must not answer.
swift build --disable-dependency-cache 2>&1 | tail -5
if ! grep -q "\"version\" : \"$version\"" Package.resolved; then
    echo "swift_example_check: Package.resolved does not pin pyfa $version:" >&2
    cat Package.resolved >&2
    exit 1
fi
"$(swift build --show-bin-path)/PyfaApp"
echo "swift_example_check: the example app built and ran against pyfa $version resolved by version"
