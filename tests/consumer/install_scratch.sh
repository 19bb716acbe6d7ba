# Sourced by the consumer tests: installs the build in BUILD_DIR ($1) into a scratch prefix,
# removed on exit, and sets `scratch` (the scratch folder) and `root` (the installed prefix).
build_dir=$1
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
meson install -C "$build_dir" --destdir "$scratch/root" --quiet >/dev/null
prefix=$(meson introspect "$build_dir" --buildoptions | python3 -c \
  'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"]=="prefix"))')
root="$scratch/root$prefix"
