r"""Convert another library's detector weights into a detlib RetinaNet folder (model.safetensors + model_config.json).

Torchvision's COCO RetinaNet v1 (36.4 AP; `retinanet_resnet50_fpn_coco-eeacb38b.pth`, downloaded elsewhere), or v2
(`retinanet_resnet50_fpn_v2_coco-5905b1c5.pth`, 41.5 AP; the version is read from the file's keys):
    python scripts/convert_weights.py --from torchvision retinanet_resnet50_fpn_coco-eeacb38b.pth --out weights/tv_retinanet

Keep the classes of a COCO json (default: torchvision's 80 COCO categories):
    python scripts/convert_weights.py --from torchvision tv.pth --out weights/tv --categories /data/coco/annotations/instances_val2017.json

Then, as they are:
    python scripts/train_retinanet.py --data_dir /data/coco --evaluate_only weights/tv_retinanet
    python scripts/predict_retinanet.py --weights weights/tv_retinanet --source photos/ --output_dir out
Fine-tune: scripts/train_retinanet.py ... --init_from weights/tv_retinanet

The folder holds a model card (README.md, in the Hub's format) too, so it can be uploaded as a Hub model repo as it is.

model_config.json carries what the model needs to reproduce torchvision's predictions (P6 from P5, its anchors,
its resize, 800 / 1333; v2: GroupNorm heads, P6 from C5): see detlib/retinanet/torchvision_weights.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys


from detlib.engine import ArgumentParser, HelpFormatter, stop


# torchvision's published box AP on COCO val2017 (its weights' documentation), quoted in the model card.
TORCHVISION_BOX_AP = {"v1": 36.4, "v2": 41.5}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)  # escapes what the console cannot write
    p.add_argument("--from", dest="source_kind", required=True, choices=["torchvision"], help="the library the weights come from")
    p.add_argument("path", help="the weights file (a torch state dict)")
    p.add_argument("--out", required=True, help="output folder (model.safetensors, model_config.json)")
    p.add_argument("--categories", help="a COCO json whose categories (ids and names) to keep (default: the 80 COCO ones)")
    p.add_argument("--image_size", type=int, default=800, help="shorter image side (torchvision's min_size)")
    p.add_argument("--max_size", type=int, default=1333, help="longest image side (torchvision's max_size)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)

    from safetensors.torch import save_file

    from detlib.evaluation import detector_card, write_card
    from detlib.files import read_json
    from detlib.retinanet import (build_retinanet_from_config, convert_torchvision_retinanet,
                                  torchvision_coco_categories, torchvision_model_config, torchvision_version)
    from detlib.weights import load_state_dict_file

    try:
        if args.categories:
            cats = sorted(read_json(args.categories)["categories"], key=lambda c: c["id"])
            ids, names = [int(c["id"]) for c in cats], [str(c["name"]) for c in cats]
        else:
            ids, names = torchvision_coco_categories()
        source = load_state_dict_file(args.path)
        version = torchvision_version(source)
        sd = convert_torchvision_retinanet(source, ids)
        config = torchvision_model_config(ids, names, args.image_size, args.max_size, version)
        # loading strictly into the model model_config.json describes proves the file will load for evaluation
        build_retinanet_from_config(config).load_state_dict(sd, strict=True)
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        stop(f"{args.path}: {type(e).__name__}: {e}", 1)
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "model.safetensors")
    save_file({k: v.contiguous() for k, v in sd.items()}, out)
    config = {**config, "converted_from": {"library": args.source_kind, "path": os.path.abspath(args.path)}}
    with open(os.path.join(args.out, "model_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    reported = TORCHVISION_BOX_AP.get(version)
    note = (f"Converted by scripts/convert_weights.py from torchvision's COCO RetinaNet {version} "
            f"({os.path.basename(args.path)})" + (f", for which torchvision reports {reported} box AP on COCO val2017"
                                                   if reported and not args.categories else "") + ".")
    write_card(detector_card(config, evaluation=None, dataset={"name": "coco" if not args.categories else
                                                               os.path.splitext(os.path.basename(args.categories))[0]},
                             command=None, weights_name=os.path.basename(os.path.abspath(args.out)), where=args.out,
                             notes=[note, "Convert command: `" + shlex.join(["python", "scripts/convert_weights.py",
                                                                            *(sys.argv[1:] if argv is None else argv)])
                                    + "`"]), args.out)
    print(f"wrote {out}, model_config.json and README.md: torchvision RetinaNet {version}, {len(ids)} classes, "
          f"{len(sd)} tensors")
    return out


if __name__ == "__main__":
    main()
