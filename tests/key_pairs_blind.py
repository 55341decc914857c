"""Labelled key pairs written after the concept lexicon and never tuned on (True: the same fact).

The held-out set (``tests/key_pairs_heldout.py``) was measured once before the lexicon's
contrast classes were written, so its look-alike pairs were seen; this set was written
afterwards, measured once, and not changed after: the blind figure. Concepts: study,
sport, home life, shopping, transport, beliefs, routines.
"""

from __future__ import annotations

SAME: tuple[tuple[str, str], ...] = (
    ("alma_mater", "university_attended"),
    ("field_of_study", "major"),
    ("graduation_year", "year_of_graduation"),
    ("gym", "fitness_club"),
    ("coffee_order", "usual_coffee_order"),
    ("tea_type", "kind_of_tea"),
    ("shopping_list", "grocery_list"),
    ("clothing_size", "clothes_size"),
    ("commute_method", "mode_of_commute"),
    ("bike_brand", "bicycle_brand"),
    ("streaming_service", "streaming_platform"),
    ("wedding_date", "date_of_wedding"),
    ("anniversary", "anniversary_date"),
    ("insurance_provider", "insurance_company"),
    ("landlord_name", "name_of_landlord"),
    ("pronouns", "gender_pronouns"),
    ("religion", "faith"),
    ("political_party", "party_affiliation"),
    ("volunteer_work", "volunteering"),
    ("instrument", "musical_instrument"),
    ("Reading-Goal", "reading_goal"),
    ("sleep_hours", "hours_of_sleep"),
)

DIFFERENT: tuple[tuple[str, str], ...] = (
    ("bachelor_degree", "master_degree"),
    ("high_school_name", "university_name"),
    ("graduation_year", "enrollment_year"),
    ("tennis_partner", "tennis_coach"),
    ("bike_brand", "car_brand"),
    ("streaming_service", "streaming_password"),
    ("coffee_order", "tea_order"),
    ("spotify_username", "netflix_username"),
    ("shopping_day", "cleaning_day"),
    ("upstairs_neighbor", "downstairs_neighbor"),
    ("landlord_name", "tenant_name"),
    ("rent_amount", "mortgage_amount"),
    ("wedding_date", "engagement_date"),
    ("first_car", "current_car"),
    ("childhood_pet", "current_pet"),
    ("daily_steps_goal", "weekly_steps_goal"),
    ("sleep_hours", "work_hours"),
    ("bedroom_count", "bathroom_count"),
    ("favorite_podcast", "favorite_playlist"),
    ("religion", "political_party"),
    ("morning_coffee", "afternoon_coffee"),
    ("insurance_provider", "internet_provider"),
    ("guitar_teacher", "piano_teacher"),
    ("lactose_intolerant", "gluten_intolerant"),
    ("train_station", "bus_stop"),
    ("ski_resort", "beach_resort"),
)
